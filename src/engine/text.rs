//! Detokenized streaming: tokens end in the middle of UTF-8 characters (byte-level BPE), so
//! pieces are buffered until they form whole characters before they are shown.

/// Accumulates token bytes and releases only complete UTF-8 text.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token's bytes; returns the text that is now complete (possibly empty).
    /// Invalid sequences (not merely incomplete ones) are replaced by U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // SAFETY-free: the prefix up to `good` was just validated.
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }

    /// Releases whatever is left (an incomplete tail becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_multibyte_characters_across_tokens() {
        let mut s = Utf8Stream::new();
        let bytes = "é⇆".as_bytes();
        assert_eq!(s.push(&bytes[..1]), "");
        assert_eq!(s.push(&bytes[1..3]), "é");
        assert_eq!(s.push(&bytes[3..]), "⇆");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement() {
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        assert_eq!(s.push(&[0xE2]), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }
}
