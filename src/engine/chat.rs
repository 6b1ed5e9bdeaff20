//! Chat prompts as tokens, with control tokens only where the template puts them.
//!
//! A rendered chat prompt mixes two kinds of text: the template's markers (`<|im_start|>`,
//! `<|im_end|>` …), which must become the model's control tokens, and the messages' content,
//! which is whatever a user typed. Tokenizing the whole rendering with special tokens parsed
//! lets a user who types `<|im_end|>` close their own turn and write a system turn. So the
//! template is rendered once with a placeholder for each message's content; the text between
//! placeholders is the template's and is tokenized with special tokens parsed, and each
//! content is tokenized as plain text (llama.cpp's `parse_special = false`).

use super::{ChatMessage, EngineError, Model, Token};

/// A placeholder no template writes and no tokenizer merges across: private-use characters
/// around the message's index.
fn placeholder(i: usize) -> String {
    format!("\u{E000}molt-content-{i}\u{E001}")
}

impl Model {
    /// The tokens of a conversation rendered with the model's chat template (the assistant's
    /// turn opened when `add_assistant` is set): the template's markers as control tokens,
    /// the messages' content as plain text, so content can never be read as a marker.
    ///
    /// # Errors
    /// [`EngineError::ChatTemplate`] when the model has no usable template or a message holds
    /// a NUL byte; [`EngineError::Tokenize`].
    pub fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        add_assistant: bool,
    ) -> Result<Vec<Token>, EngineError> {
        if messages.iter().any(|m| m.content.contains('\0')) {
            return Err(EngineError::ChatTemplate("message contains NUL".into()));
        }
        let shells: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage::new(&m.role, &placeholder(i)))
            .collect();
        let rendered = self.apply_chat_template(&shells, add_assistant)?;
        let mut tokens = self.tokenize_with("", self.adds_bos(), false)?;
        let mut rest = rendered.as_str();
        for (i, m) in messages.iter().enumerate() {
            // A template may leave a message out (some drop an empty system turn); its
            // content is then not part of the prompt.
            let mark = placeholder(i);
            let Some(at) = rest.find(&mark) else { continue };
            tokens.extend(self.tokenize_with(&rest[..at], false, true)?);
            tokens.extend(self.tokenize_with(&m.content, false, false)?);
            rest = &rest[at + mark.len()..];
        }
        tokens.extend(self.tokenize_with(rest, false, true)?);
        Ok(tokens)
    }
}
