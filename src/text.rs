//! The calls that take and give text: tokenizing, detokenizing, chat templates, and generation
//! and scoring through the model's tokenizer ([`crate::tokenizer`]).

use crate::error::{Error, Result};
use crate::shared::Shared;
use crate::tokenizer::{ChatMessage, StopStrings, Tokenizer};
use crate::{GenerateParams, Model, Session, Speculation};

/// How a text call turns its prompt into tokens and the generated tokens into text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextParams {
    /// Generation ends once the generated text contains one of these (a string split across
    /// tokens included); the text returned ends before it. Empty strings are refused.
    pub stop: Vec<String>,
    /// Add the tokenizer's special tokens to the prompt (its BOS, ...). A prompt rendered by a
    /// chat template has them already.
    pub add_special_tokens: bool,
    /// Leave special tokens out of the generated text.
    pub skip_special_tokens: bool,
}

impl Default for TextParams {
    fn default() -> Self {
        TextParams {
            stop: Vec::new(),
            add_special_tokens: true,
            skip_special_tokens: true,
        }
    }
}

/// What a text generation call produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GeneratedText {
    /// The generated text (the concatenation of the streamed pieces).
    pub text: String,
    /// The generated tokens (the end-of-sequence token that ended generation excluded; a stop
    /// string's tokens included).
    pub tokens: Vec<u32>,
}

/// A text's tokens and the log-probability of each after the first.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoredText {
    pub tokens: Vec<u32>,
    /// `log p(tokens[i+1] | tokens[..=i])`, `tokens.len() - 1` values.
    pub logprobs: Vec<f32>,
}

fn tokenizer_of(shared: &Shared) -> Result<&Tokenizer> {
    shared.tokenizer.as_ref().ok_or_else(|| {
        let named = shared.info.metadata.get(crate::tokenizer::KEY_TOKENIZER);
        let named = named.map_or("no tokenizer".to_string(), |v| format!("tokenizer {v}"));
        Error::invalid(format!(
            "the model has no tokenizer (its metadata names {named} and its vocab_size is {}, \
             not 256 bytes): pass token ids instead of text",
            shared.config().vocab_size
        ))
    })
}

impl Model {
    /// The model's tokenizer, or an error saying that it has none.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        tokenizer_of(&self.shared)
    }

    /// The token ids of `text` (see [`Tokenizer::encode`]).
    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.tokenizer()?.encode(text, add_special_tokens)
    }

    /// The text of `tokens`, each below `vocab_size`.
    pub fn detokenize(&self, tokens: &[u32], skip_special_tokens: bool) -> Result<String> {
        let vocab = self.config().vocab_size;
        if let Some(i) = tokens.iter().position(|&t| t as usize >= vocab) {
            return Err(Error::invalid(format!(
                "tokens[{i}] is {}, outside the vocabulary (vocab_size {vocab})",
                tokens[i]
            )));
        }
        self.tokenizer()?.decode(tokens, skip_special_tokens)
    }

    /// `messages` rendered by the model's chat template (see
    /// [`Tokenizer::apply_chat_template`]).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.tokenizer()?
            .apply_chat_template(messages, add_generation_prompt)
    }
}

/// A generation call on tokens: the prompt, the parameters and the token callback.
type TokenCall<'s> = dyn FnOnce(&mut Session, &[u32], &GenerateParams, &mut dyn FnMut(u32) -> bool) -> Result<Vec<u32>>
    + 's;

impl Session {
    /// Generate after the text `prompt`; returns the generated text. Generation also ends at
    /// the tokenizer's end-of-sequence tokens and at `text.stop`.
    pub fn generate_text(
        &mut self,
        prompt: &str,
        params: &GenerateParams,
        text: &TextParams,
    ) -> Result<GeneratedText> {
        self.generate_text_stream(prompt, params, text, &mut |_| true)
    }

    /// Like [`Session::generate_text`], calling `on_text` with each piece of text as soon as it
    /// is known: pieces never split a character, and never hold part of a stop string.
    /// Returning false ends generation (not an error).
    pub fn generate_text_stream(
        &mut self,
        prompt: &str,
        params: &GenerateParams,
        text: &TextParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<GeneratedText> {
        let call: Box<TokenCall> =
            Box::new(|s, prompt, params, on_token| s.generate_stream(prompt, params, on_token));
        self.run_text(prompt, params, text, on_text, call)
    }

    /// [`Session::generate_text_stream`] drafting at `spec.draft_loops` and verifying at
    /// `params.loops` ([`Session::generate_speculative`]).
    pub fn generate_text_speculative(
        &mut self,
        prompt: &str,
        params: &GenerateParams,
        spec: &Speculation,
        text: &TextParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<GeneratedText> {
        let call: Box<TokenCall> = Box::new(|s, prompt, params, on_token| {
            s.generate_speculative(prompt, params, spec, on_token)
        });
        self.run_text(prompt, params, text, on_text, call)
    }

    /// The log-probability of each token of `text` given those before it (tokenized with the
    /// tokenizer's special tokens, so a BOS makes the first text token scored too).
    pub fn score_text(&mut self, text: &str, loops: Option<usize>) -> Result<ScoredText> {
        let tokens = tokenizer_of(&self.shared)?.encode(text, true)?;
        if tokens.len() < 2 {
            return Err(Error::invalid(format!(
                "the text is {} token(s); scoring needs at least 2",
                tokens.len()
            )));
        }
        let logprobs = self.logprobs(&tokens, loops)?;
        Ok(ScoredText { tokens, logprobs })
    }

    /// The shared path of the text generation calls: tokenize, run `call` with the
    /// end-of-sequence ids added to the stop tokens, and turn its tokens into text pieces.
    fn run_text(
        &mut self,
        prompt: &str,
        params: &GenerateParams,
        text: &TextParams,
        on_text: &mut dyn FnMut(&str) -> bool,
        call: Box<TokenCall>,
    ) -> Result<GeneratedText> {
        let shared = self.shared.clone();
        let tokenizer = tokenizer_of(&shared)?;
        let mut stops = StopStrings::new(text.stop.clone())?;
        let prompt = tokenizer.encode(prompt, text.add_special_tokens)?;
        let mut params = params.clone();
        for &eos in tokenizer.eos_tokens() {
            if !params.stop_tokens.contains(&eos) {
                params.stop_tokens.push(eos);
            }
        }
        let mut stream = tokenizer.stream(text.skip_special_tokens);
        let mut out = String::new();
        let mut emit = |piece: &str, out: &mut String| {
            out.push_str(piece);
            piece.is_empty() || on_text(piece)
        };
        let (mut ended, mut failure) = (false, None);
        let tokens = call(self, &prompt, &params, &mut |token| {
            let (piece, stopped) = match stream.push(token) {
                Ok(piece) => stops.push(&piece),
                Err(e) => {
                    failure = Some(e);
                    return false;
                }
            };
            let go_on = emit(&piece, &mut out);
            ended = stopped || !go_on;
            !ended
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        if !ended {
            // Characters that never completed, then text held as a possible stop string.
            let (piece, stopped) = stops.push(&stream.finish()?);
            let rest = if stopped {
                String::new()
            } else {
                stops.finish()
            };
            emit(&(piece + &rest), &mut out);
        }
        Ok(GeneratedText { text: out, tokens })
    }
}
