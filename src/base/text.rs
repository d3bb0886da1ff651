//! Text a machine or a network peer sent, on its way to an operator's terminal: control
//! characters (C0, DEL, C1) and the bidirectional controls could erase or forge what a table
//! shows, set a terminal's title, or reorder a line. They are refused where text enters
//! (claims: `join:claims`; the admin API: `INVALID_INPUT`) and escaped wherever stored text is
//! printed, so text stored before the rule, or by another way in, still reaches no terminal raw.

use std::borrow::Cow;

/// A character no terminal may receive raw from a stored value.
pub fn is_control(c: char) -> bool {
    c.is_control() // C0, DEL and C1
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{061c}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Whether `s` holds a character [`is_control`] refuses.
pub fn has_control(s: &str) -> bool {
    s.chars().any(is_control)
}

/// `s` with each control character written as `\u{..}`, visible and inert.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !has_control(s) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(
        s.chars()
            .map(|c| {
                if is_control(c) {
                    format!("\\u{{{:x}}}", c as u32)
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// The JSON path of the first string (or object key) in `v` with a control character.
pub fn first_control(v: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match v {
        Value::String(s) => has_control(s).then(String::new),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .find_map(|(i, x)| first_control(x).map(|p| format!("[{i}]{p}"))),
        Value::Object(o) => o.iter().find_map(|(k, x)| {
            if has_control(k) {
                return Some(format!(".{}", escape(k)));
            }
            first_control(x).map(|p| format!(".{k}{p}"))
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_are_found_and_escaped() {
        for bad in [
            "a\u{1b}[2J",
            "x\u{7}",
            "\u{9b}31m",
            "r\u{202e}gnp.exe",
            "t\u{2066}",
            "\0",
        ] {
            assert!(has_control(bad), "{bad:?}");
            assert!(!has_control(&escape(bad)), "{bad:?}");
        }
        assert_eq!(escape("a\u{1b}]0;x\u{7}"), "a\\u{1b}]0;x\\u{7}");
        assert_eq!(escape("plain ünïcode"), "plain ünïcode");
        let v = serde_json::json!({"a": [1, {"b": "ok", "c": "bad\u{1b}"}]});
        assert_eq!(first_control(&v).as_deref(), Some(".a[1].c"));
        assert_eq!(first_control(&serde_json::json!({"ok": "fine"})), None);
    }
}
