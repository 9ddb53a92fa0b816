//! Chat templates: the Jinja template of `tokenizer_config.chat_template`, rendered with
//! minijinja the way transformers renders it (blocks trimmed, Python string methods, a
//! `raise_exception` function).

use std::collections::BTreeMap;

use minijinja::{Environment, ErrorKind, Value};

use crate::error::{Error, Result};

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`, or another role the template knows.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compile `source`; the error describes a syntax error.
    pub fn new(source: String) -> std::result::Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(NAME, source)
            .map_err(|e| e.to_string())?;
        Ok(ChatTemplate { env })
    }

    /// Render `messages`; `named` are the special tokens by name (`bos_token`, `eos_token`, ...).
    pub fn render<'a>(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        named: impl Iterator<Item = (&'a str, &'a str)>,
    ) -> Result<String> {
        let mut context: BTreeMap<&str, Value> = named.map(|(k, v)| (k, Value::from(v))).collect();
        context.insert("messages", Value::from_serialize(messages));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| Error::invalid(format!("chat template: {e}")))?;
        template
            .render(context)
            .map_err(|e| Error::invalid(format!("chat template: {e}")))
    }
}

/// `raise_exception(message)`, which templates call to refuse a conversation.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}
