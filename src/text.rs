//! Words for what a client sent: capping text to a number of characters without splitting
//! one, naming the kind of a JSON value in an error message, and reading bytes as text.
//!
//! Caps counted in bytes need no helper: `str::floor_char_boundary` (keep the head) and
//! `str::ceil_char_boundary` (keep the tail) give the cut.

/// `bytes` as text with invalid sequences replaced, as `String::from_utf8_lossy` gives it;
/// valid bytes (nearly all a stream carries) are checked by `str::from_utf8`, whose ASCII
/// path reads a word at a time where the lossy scan reads a byte.
pub(crate) fn lossy(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.into(),
        Err(_) => String::from_utf8_lossy(bytes),
    }
}

/// Appends `text` to `out` as a JSON string, quotes included, escaped exactly as
/// `serde_json` escapes it (so output does not depend on which of the two wrote it). For
/// text embedded in text, like a poll body inside an MCP tool result, written where the
/// message is built.
pub(crate) fn push_json_string(out: &mut Vec<u8>, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(text.len() + 2);
    out.push(b'"');
    let bytes = text.as_bytes();
    let mut run = 0;
    for (i, &byte) in bytes.iter().enumerate() {
        let short: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..0x20 => b"",
            _ => continue,
        };
        out.extend_from_slice(bytes.get(run..i).unwrap_or_default());
        run = i + 1;
        if short.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(byte >> 4)]);
            out.push(HEX[usize::from(byte & 0xf)]);
        } else {
            out.extend_from_slice(short);
        }
    }
    out.extend_from_slice(bytes.get(run..).unwrap_or_default());
    out.push(b'"');
}

/// `text` split after its first `max_chars` characters into what is kept and what is
/// dropped, or `None` when it has no more than `max_chars`.
pub(crate) fn cut_chars(text: &str, max_chars: usize) -> Option<(&str, &str)> {
    let (cut, _) = text.char_indices().nth(max_chars)?;
    Some(text.split_at(cut))
}

/// `text` cut to its first `max_chars` characters, with `…` marking a cut.
pub(crate) fn cap_chars(text: &str, max_chars: usize) -> String {
    match cut_chars(text, max_chars) {
        Some((kept, _)) => format!("{kept}…"),
        None => text.to_owned(),
    }
}

/// The kind of a JSON value as an error message names it ("expected a string, got a number").
pub(crate) fn json_kind(value: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One character of each UTF-8 width, twice.
    const MIXED: &str = "aé€😀aé€😀";

    #[test]
    fn json_strings_are_escaped_as_serde_json_escapes_them() {
        let every_ascii: String = (0u8..=0x7f).map(char::from).collect();
        for text in [
            &every_ascii[..],
            "",
            "plain",
            "é🦀\u{2028}\u{fffd}",
            "\"\\\"\n\u{1}end",
        ] {
            let mut out = b"[".to_vec();
            push_json_string(&mut out, text);
            let want = format!("[{}", serde_json::to_string(text).unwrap());
            assert_eq!(String::from_utf8(out).unwrap(), want);
        }
    }

    #[test]
    fn lossy_is_from_utf8_lossy() {
        for bytes in [&b"plain"[..], "é🦀".as_bytes(), b"a\xffb\xe2\x82", b""] {
            assert_eq!(lossy(bytes), String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn cut_chars_at_every_split_point() {
        let chars: Vec<char> = MIXED.chars().collect();
        for max in 0..=chars.len() + 1 {
            let got = cut_chars(MIXED, max);
            if max >= chars.len() {
                assert_eq!(got, None, "max {max}");
                continue;
            }
            let (kept, dropped) = got.unwrap();
            assert_eq!(kept, chars[..max].iter().collect::<String>(), "max {max}");
            assert_eq!(
                dropped,
                chars[max..].iter().collect::<String>(),
                "max {max}"
            );
        }
        assert_eq!(cut_chars("", 0), None);
    }

    #[test]
    fn cap_chars_at_every_split_point() {
        let chars: Vec<char> = MIXED.chars().collect();
        for max in 0..=chars.len() + 1 {
            let want = if max >= chars.len() {
                MIXED.to_owned()
            } else {
                format!("{}…", chars[..max].iter().collect::<String>())
            };
            assert_eq!(cap_chars(MIXED, max), want, "max {max}");
        }
        assert_eq!(cap_chars("", 0), "");
        assert_eq!(cap_chars("ab", 0), "…");
    }
}
