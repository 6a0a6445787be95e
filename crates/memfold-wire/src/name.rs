//! Names peers give memfoldd (an agent's guest name, [`crate::ToDaemon::AgentHello`]),
//! and how memfoldd shows a peer's words.
//!
//! A guest's name is the agent's word: memfoldd keeps it, logs it and sends it in every
//! operator's statistics ([`crate::VmStats::name`]). Unbounded, one hello could make
//! every statistics answer ~250 KiB larger (past what the socket takes in one message),
//! and a name with control characters could forge log lines or drive an operator's
//! terminal. So a name is at most [`MAX_NAME_BYTES`] bytes of printable characters
//! ([`check_name`]), and a refused one is shown escaped and shortened ([`shown`]).

/// Most bytes (UTF-8) in a guest's name. QEMU's `-name` and libvirt's domain names are
/// far shorter in practice; the statistics carry the name for every guest.
pub const MAX_NAME_BYTES: usize = 255;

/// Most characters of a peer's words [`shown`] keeps (then `...`).
pub const SHOWN_CHARS: usize = 200;

/// Why a guest's name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// No name at all.
    #[error("an empty guest name")]
    Empty,
    /// Longer than [`MAX_NAME_BYTES`].
    #[error("a guest name of {len} bytes (at most {MAX_NAME_BYTES}): {shown}")]
    TooLong {
        /// The name's length, bytes.
        len: usize,
        /// The name as [`shown`] shows it (escaped, shortened).
        shown: String,
    },
    /// A control character (an escape, a newline, C1 controls) or an invisible format
    /// character (a bidirectional override, a zero-width character, a line separator...).
    #[error("a guest name with the unprintable character {ch:?} at byte {at}: {shown}")]
    Unprintable {
        /// The character.
        ch: char,
        /// Its byte offset in the name.
        at: usize,
        /// The name as [`shown`] shows it (escaped, shortened).
        shown: String,
    },
}

/// Checks a guest's name as memfoldd takes it at the hello: 1 to [`MAX_NAME_BYTES`]
/// bytes, with no control character and no invisible format character ([`invisible`]).
/// Any other character passes — libvirt's domain names may hold dashes, symbols, marks
/// and scripts of every kind — and [`shown`] escapes what is not ASCII wherever memfoldd
/// logs or shows a name.
///
/// Errors: [`NameError`], saying why, with the name shown escaped and shortened.
pub fn check_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(NameError::TooLong {
            len: name.len(),
            shown: shown(name),
        });
    }
    let printable = |c: char| !c.is_control() && !invisible(c);
    match name.char_indices().find(|&(_, c)| !printable(c)) {
        Some((at, ch)) => Err(NameError::Unprintable {
            ch,
            at,
            shown: shown(name),
        }),
        None => Ok(()),
    }
}

/// Whether `c` is one of Unicode's invisible format characters that can make a name
/// look like another or reorder what follows it: bidirectional marks, embeddings,
/// overrides and isolates, zero-width characters, the soft hyphen, the word joiner and
/// invisible operators, the byte order mark, interlinear annotation marks, and the line
/// and paragraph separators.
pub fn invisible(c: char) -> bool {
    matches!(
        c,
        '\u{ad}'
            | '\u{61c}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}'
            | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}'
    )
}

/// A peer's words (a name, an error it sent or one that quotes what it sent) as memfoldd
/// logs and shows them: printable ASCII, anything else escaped (`\n`, `\u{1b}`), at most
/// [`SHOWN_CHARS`] characters then `...` — so a peer cannot forge log lines or drive an
/// operator's terminal with escapes, nor fill a line.
pub fn shown(words: &str) -> String {
    shown_within(words, SHOWN_CHARS)
}

/// A peer's words as [`shown`] shows them, kept to at most `chars` characters (then
/// `...`): for text that quotes a peer inside a longer line of memfoldd's own.
pub fn shown_within(words: &str, chars: usize) -> String {
    let mut out = String::new();
    for c in words.chars() {
        if c == ' ' || c.is_ascii_graphic() {
            out.push(c);
        } else {
            out.extend(c.escape_default());
        }
        if out.len() >= chars {
            // Only ASCII was pushed: any byte is a character boundary.
            out.truncate(chars);
            out.push_str("...");
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names QEMU and libvirt give pass; long, empty and unprintable ones are refused
    /// with the name shown short and escaped.
    #[test]
    fn names_are_bounded_and_printable() {
        for ok in [
            "web",
            "db-1/ram1",
            "my vm (test)",
            "gäst-ü",
            "虚拟机",
            // Dashes, symbols, combining marks and viramas are in libvirt's names too.
            "web–prod",
            "Jose\u{301}",
            "परीक्षण",
            "vm-🚀™·",
            &"x".repeat(255),
        ] {
            assert_eq!(check_name(ok), Ok(()), "{ok}");
        }
        assert_eq!(check_name(""), Err(NameError::Empty));
        let e = check_name(&"y".repeat(256)).unwrap_err();
        assert!(matches!(&e, NameError::TooLong { len: 256, .. }), "{e}");
        let long = check_name(&"z".repeat(200 * 1024)).unwrap_err().to_string();
        assert!(
            long.starts_with("a guest name of 204800 bytes (at most 255): zzz"),
            "{long:.80}"
        );
        assert!(long.len() < 300, "{}", long.len());
        for (bad, ch, at) in [
            ("a\nb", '\n', 1),
            ("x\u{1b}[2J", '\u{1b}', 1),
            ("ab\u{202e}cd", '\u{202e}', 2),
            ("zero\u{200b}width", '\u{200b}', 4),
            ("del\u{7f}", '\u{7f}', 3),
            ("c1\u{85}", '\u{85}', 2),
            ("tab\t", '\t', 3),
            ("soft\u{ad}hyphen", '\u{ad}', 4),
            ("line\u{2028}sep", '\u{2028}', 4),
            ("bom\u{feff}", '\u{feff}', 3),
        ] {
            let e = check_name(bad).unwrap_err();
            assert!(
                matches!(&e, NameError::Unprintable { ch: c, at: a, .. } if *c == ch && *a == at),
                "{bad:?}: {e}"
            );
            let s = e.to_string();
            assert!(s.chars().all(|c| c == ' ' || c.is_ascii_graphic()), "{s}");
        }
    }

    /// A peer's words reach the log and the operator's view without control characters
    /// or escapes, and short.
    #[test]
    fn words_are_shown_escaped_and_short() {
        let e = shown("no kpageflags\n2026 WARN forged\u{1b}[2J\u{202e}");
        assert_eq!(e, "no kpageflags\\n2026 WARN forged\\u{1b}[2J\\u{202e}");
        assert_eq!(shown(&"x".repeat(5000)).len(), SHOWN_CHARS + 3);
        assert_eq!(shown_within("ab\ncd", 4), "ab\\n...");
        assert_eq!(shown_within(&"\u{1b}".repeat(5000), 500).len(), 503);
    }
}
