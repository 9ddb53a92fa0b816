//! Text as tokens arrive: [`TextStream`] turns tokens into pieces that never split a character,
//! [`StopStrings`] holds back text that may be the start of a stop string.

use super::Tokenizer;
use crate::error::{Error, Result};

const REPLACEMENT: char = '\u{FFFD}';

/// Decodes tokens one at a time into text pieces whose concatenation is the decoded text.
///
/// One token may carry part of a character (byte fallback, byte-level BPE, a byte-level model):
/// the decoded text then ends in U+FFFD, and the token is held until a later one completes the
/// character. Each step decodes the pending tokens together with the tokens of the last piece,
/// so that decoders which depend on neighbours (a leading space dropped at the start of a
/// sequence, say) see the same context as in a whole decode.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    /// The tokens of the last piece, then those not yet in any piece.
    ids: Vec<u32>,
    /// How many of `ids` belong to the last piece.
    context: usize,
    /// The text of `ids[..context]`.
    context_text: String,
}

impl<'a> TextStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        TextStream {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            context: 0,
            context_text: String::new(),
        }
    }

    /// The text `token` completes ("" while it waits for the rest of a character, or when it
    /// decodes to nothing).
    pub fn push(&mut self, token: u32) -> Result<String> {
        self.ids.push(token);
        let text = self.decode(&self.ids)?;
        if text.ends_with(REPLACEMENT) {
            return Ok(String::new());
        }
        let piece = self.after_context(&text).to_string();
        self.ids.drain(..self.context);
        self.context = self.ids.len();
        self.context_text = self.decode(&self.ids)?;
        Ok(piece)
    }

    /// The text of the tokens still held (characters that never completed decode to U+FFFD).
    pub fn finish(&mut self) -> Result<String> {
        if self.ids.len() == self.context {
            return Ok(String::new());
        }
        let text = self.decode(&self.ids)?;
        let piece = self.after_context(&text).to_string();
        self.ids.clear();
        (self.context, self.context_text) = (0, String::new());
        Ok(piece)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, self.skip_special_tokens)
    }

    /// What `text` adds to the context's text. A decoder that rewrites earlier text once later
    /// tokens arrive (cleanup of spaces) cannot take back what was emitted: the piece then
    /// starts where the two texts first differ.
    fn after_context<'t>(&self, text: &'t str) -> &'t str {
        let common = self
            .context_text
            .char_indices()
            .zip(text.chars())
            .find(|((_, a), b)| a != b)
            .map_or(self.context_text.len().min(text.len()), |((i, _), _)| i);
        &text[common..]
    }
}

/// Finds stop strings in streamed text. Text is released as soon as it cannot be part of a stop
/// string; a stop string split across pieces is found all the same.
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
}

impl StopStrings {
    /// `stops` must not be empty strings.
    pub fn new(stops: Vec<String>) -> Result<Self> {
        if let Some(i) = stops.iter().position(String::is_empty) {
            return Err(Error::invalid(format!("stop string {i} is empty")));
        }
        Ok(StopStrings {
            stops,
            held: String::new(),
        })
    }

    /// Add a piece: the text now safe to release, and whether a stop string completed (the
    /// released text then ends where the earliest one starts, and the rest is dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = found {
            self.held.truncate(at);
            return (std::mem::take(&mut self.held), true);
        }
        let keep = self.partial_stop_len();
        let release = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (release, false)
    }

    /// The text still held (no stop string completed).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The length of the longest end of `held` that begins some stop string.
    fn partial_stop_len(&self) -> usize {
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .map_or(0, |i| self.held.len() - i)
    }
}
