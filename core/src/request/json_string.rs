//! JSON strings, the bulk of a chat body (its message texts).
//!
//! serde_json checks a string eight bytes per step, testing its mask after
//! each eight, then validates the string's UTF-8 in a second pass. Here a
//! plain run is checked 32 bytes per step for the bytes that end it (`"`,
//! `\`, control bytes) and, in the same masks, for non-ASCII bytes: an ASCII
//! string needs no UTF-8 pass. A 30 KB chat body parses in 4.4–6.1 µs
//! instead of 7.0–11.2, a 128 KB one in 15.4–16.4 instead of 28.2–29.7
//! (`make bench-phases-wasm`, node's V8, alternated runs).
//!
//! The escapes JSON writers use (`\n`, `\"`, `\uXXXX`…) are decoded here.
//! Anything else this reader does not take (control bytes, a lone
//! surrogate, invalid UTF-8, a string without its end) is read again by
//! serde, which words the error: errors are serde's.

use super::{json_value, ParseError};
use std::borrow::Cow;

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH_BITS: u64 = ONES * 0x80;
/// Bytes checked per step of a plain run.
const STEP: usize = 32;

/// The JSON string at the start of `value` (which starts with `"`), and
/// the bytes it took. Borrowed when it has no escapes.
pub(super) fn read_string(value: &[u8]) -> Result<(Cow<'_, str>, usize), ParseError> {
    match read_plain(value) {
        Some(read) => Ok(read),
        None => json_value::<Cow<str>>(value),
    }
}

/// [`read_string`] for the strings this reader takes; `None` for the rest.
fn read_plain(value: &[u8]) -> Option<(Cow<'_, str>, usize)> {
    let text = value.strip_prefix(b"\"")?;
    let mut decoded: Vec<u8> = Vec::new();
    // `text[copied..i]` is read but not yet in `decoded`.
    let (mut copied, mut i) = (0, 0);
    let mut ascii = true;
    loop {
        i += run_length(&text[i..], ascii);
        match *text.get(i)? {
            b'"' => break,
            b'\\' => {
                decoded.extend_from_slice(&text[copied..i]);
                i += unescape(&text[i..], &mut decoded)?;
                copied = i;
            }
            byte if byte >= 0x80 => ascii = false,
            _ => return None,
        }
    }
    let bytes = if copied == 0 {
        Cow::Borrowed(&text[..i])
    } else {
        decoded.extend_from_slice(&text[copied..i]);
        Cow::Owned(decoded)
    };
    Some((utf8(bytes, ascii)?, i + 2))
}

/// `bytes` as text: `None` if it is not UTF-8. `ascii` says the reader
/// checked every byte taken from the input below 0x80.
fn utf8(bytes: Cow<'_, [u8]>, ascii: bool) -> Option<Cow<'_, str>> {
    debug_assert!(!ascii || std::str::from_utf8(&bytes).is_ok());
    Some(match bytes {
        // SAFETY: `ascii`: every byte from the input is ASCII, and what
        // `unescape` added was written by `char::encode_utf8`.
        Cow::Borrowed(b) if ascii => Cow::Borrowed(unsafe { std::str::from_utf8_unchecked(b) }),
        Cow::Owned(b) if ascii => Cow::Owned(unsafe { String::from_utf8_unchecked(b) }),
        Cow::Borrowed(b) => Cow::Borrowed(std::str::from_utf8(b).ok()?),
        Cow::Owned(b) => Cow::Owned(String::from_utf8(b).ok()?),
    })
}

/// How many bytes at the start of `text` need no attention: up to the first
/// `"`, `\\`, control byte or (while `ascii`) non-ASCII byte, or its end.
fn run_length(text: &[u8], ascii: bool) -> usize {
    if ascii {
        run_length_of::<true>(text)
    } else {
        run_length_of::<false>(text)
    }
}

fn run_length_of<const ASCII: bool>(text: &[u8]) -> usize {
    let word_at = |i: usize| {
        let bytes = text.get(i..i + 8).and_then(|w| w.try_into().ok());
        u64::from_le_bytes(bytes.unwrap_or_default())
    };
    let mut i = 0;
    while i + STEP <= text.len() {
        let stops = (0..STEP)
            .step_by(8)
            .fold(0, |stops, at| stops | stop_bytes::<ASCII>(word_at(i + at)));
        if stops != 0 {
            break;
        }
        i += STEP;
    }
    while i + 8 <= text.len() {
        let stops = stop_bytes::<ASCII>(word_at(i));
        if stops != 0 {
            return i + (stops.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    let is_stop = |&b: &u8| b == b'"' || b == b'\\' || b < 0x20 || (ASCII && b >= 0x80);
    i + text[i..].iter().position(is_stop).unwrap_or(text.len() - i)
}

/// The high bit of each byte of `word` that is `"`, `\\`, a control byte
/// or (if `ASCII`) non-ASCII. A borrow can also mark bytes above a marked
/// one, never below: the lowest mark is exact.
#[inline(always)]
fn stop_bytes<const ASCII: bool>(word: u64) -> u64 {
    let control = word.wrapping_sub(ONES * 0x20);
    let quote = word ^ (ONES * u64::from(b'"'));
    let backslash = word ^ (ONES * u64::from(b'\\'));
    let quote_mark = quote.wrapping_sub(ONES);
    let backslash_mark = backslash.wrapping_sub(ONES);
    if ASCII {
        // Each mark that is wrong sits on a byte of 0x80 or more, which
        // stops the run anyway.
        (control | quote_mark | backslash_mark | word) & HIGH_BITS
    } else {
        (control & !word | quote_mark & !quote | backslash_mark & !backslash) & HIGH_BITS
    }
}

/// Decodes the escape at the start of `text` (which starts with `\`) into
/// `out`; the bytes it took. `None` for an escape left to serde: an invalid
/// one, or a surrogate that is not a whole pair.
fn unescape(text: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    let byte = match *text.get(1)? {
        b'"' => b'"',
        b'\\' => b'\\',
        b'/' => b'/',
        b'b' => 0x08,
        b'f' => 0x0c,
        b'n' => b'\n',
        b'r' => b'\r',
        b't' => b'\t',
        b'u' => return unescape_unicode(text, out),
        _ => return None,
    };
    out.push(byte);
    Some(2)
}

/// `\uXXXX`, or a surrogate pair `\uD8XX\uDCXX`, into `out`.
fn unescape_unicode(text: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    let first = hex4(text.get(2..6)?)?;
    let (code, used) = match first {
        0xD800..=0xDBFF => {
            if text.get(6..8)? != b"\\u" {
                return None;
            }
            let second = hex4(text.get(8..12)?)?;
            if !(0xDC00..=0xDFFF).contains(&second) {
                return None;
            }
            (0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00), 12)
        }
        _ => (first, 6),
    };
    let c = char::from_u32(code)?;
    out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
    Some(used)
}

/// Four hex digits as a number.
fn hex4(digits: &[u8]) -> Option<u32> {
    digits
        .iter()
        .try_fold(0, |n, &d| Some(n * 16 + char::from(d).to_digit(16)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::xorshift;

    /// Pieces a string is made of: plain ASCII, UTF-8, every escape form,
    /// and what only serde takes (control bytes, bad escapes and UTF-8,
    /// lone surrogates).
    const PIECES: [&[u8]; 24] = [
        b"a",
        b"plain words ",
        b"0123456789abcdefghijklmnopqrstuvwxyz",
        "é".as_bytes(),
        "日本語".as_bytes(),
        "😀".as_bytes(),
        b"\\n",
        b"\\\"",
        b"\\\\",
        b"\\/",
        b"\\b\\f\\r\\t",
        b"\\u00e9",
        b"\\u65E5",
        b"\\ud83d\\ude00",
        b"\\u0000",
        b"\x7f",
        b"\x01",
        b"\\x",
        b"\\u12g4",
        b"\\ud83d",
        b"\\ude00",
        b"\\ud83d\\u0041",
        b"\xff",
        b"\xe6\x97",
    ];

    #[test]
    fn strings_read_as_serde_reads_them() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        let (mut plain, mut escaped, mut non_ascii) = (0, 0, 0);
        for case in 0..20_000 {
            let mut value = b"\"".to_vec();
            // Long plain runs for the 32-byte steps, short ones for the tails.
            let pieces = next() % if case % 4 == 0 { 200 } else { 12 };
            for _ in 0..pieces {
                // Mostly the pieces every reader takes.
                let pick = next() as usize % if next() % 8 == 0 { PIECES.len() } else { 15 };
                value.extend_from_slice(PIECES[pick]);
            }
            value.push(b'"');
            if next() % 8 == 0 {
                value.truncate(1 + next() as usize % (value.len() - 1));
            }
            value.extend_from_slice(b", \"next\"");
            let by_serde = json_value::<Cow<str>>(&value);
            if let Some((text, used)) = read_plain(&value) {
                let (serde_text, serde_used) = by_serde.unwrap_or_else(|e| {
                    panic!("serde refused {:?}: {e}", String::from_utf8_lossy(&value))
                });
                assert_eq!((text.as_ref(), used), (serde_text.as_ref(), serde_used));
                plain += 1;
                escaped += usize::from(matches!(text, Cow::Owned(_)));
                non_ascii += usize::from(!text.is_ascii());
            }
            // Whatever this reader leaves, serde reads (or refuses) alone.
            let both = (read_string(&value), json_value::<Cow<str>>(&value));
            match both {
                (Ok((a, n)), Ok((b, m))) => assert_eq!((a, n), (b, m)),
                (Err(a), Err(b)) => assert_eq!(a, b),
                other => panic!("{:?}: {other:?}", String::from_utf8_lossy(&value)),
            }
        }
        // The fast reader really read most cases, of every kind.
        assert!(
            plain > 10_000 && escaped > 3_000 && non_ascii > 3_000,
            "{plain} {escaped} {non_ascii}"
        );
    }

    #[test]
    fn runs_stop_at_the_first_byte_that_ends_them() {
        for len in 0..100 {
            for stop in [b'"', b'\\', 0x00, 0x1f, 0x80, 0xff] {
                let mut text = vec![b'x'; len];
                text.push(stop);
                text.extend_from_slice(b"\"\\\x01");
                assert_eq!(run_length(&text, true), len, "{len} {stop:#x}");
                let expected = if stop >= 0x80 { len + 1 } else { len };
                assert_eq!(run_length(&text, false), expected, "{len} {stop:#x}");
            }
            // Bytes around the stops (space, DEL, 0x21, 0x5b, 0x5d) never stop a run.
            let text: Vec<u8> = b" \x7f!#[]".iter().copied().cycle().take(len).collect();
            assert_eq!(run_length(&text, true), len);
        }
    }
}
