//! JSON arrays of token ids (`[1, 2, 3]`), the largest bodies kvroute reads.
//!
//! Hand-rolled because serde's generic number path costs ~10 ns per id.
//! Anything but non-negative integers that fit u32, written as JSON writes
//! them (no leading zero), is an error.
//!
//! Where an id starts depends on how long the one before it is, so one walk
//! through the array is a chain of dependent steps (load, find the first
//! non-digit, add) that leaves the core mostly idle. A long array is read as
//! two halves, split at a comma near its middle, in one loop, so the two
//! chains overlap: a body of 8,192 ids parses in 31 µs instead of 45
//! natively, 38–41 instead of 45–48 in V8. Whatever the halves cannot read is read
//! again by one walk, which alone words the errors.

use super::{skip_whitespace, ParseError};

/// Below this many bytes one walk is as fast: setting up two costs more
/// than their overlap saves.
const TWO_WALKS_MIN_BYTES: usize = 1024;

/// What follows an id: the next id's position, or the position after `]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    Next(usize),
    Close(usize),
}

/// The array of token ids at the start of `bytes` (after whitespace), and
/// the bytes consumed.
pub(super) fn parse_token_ids(bytes: &[u8]) -> Result<(Vec<u32>, usize), ParseError> {
    let open = skip_whitespace(bytes, 0);
    if bytes.get(open) != Some(&b'[') {
        return Err(malformed("expected an array"));
    }
    let first = skip_whitespace(bytes, open + 1);
    if bytes.get(first) == Some(&b']') {
        return Ok((Vec::new(), first + 1));
    }
    if bytes.len() >= TWO_WALKS_MIN_BYTES {
        if let Some(parsed) = two_walks(bytes, first) {
            return Ok(parsed);
        }
    }
    one_walk(bytes, first)
}

fn malformed(what: &str) -> ParseError {
    ParseError::Malformed(format!("token ids: {what}"))
}

/// The ids from `first` to `]`, one after the other.
fn one_walk(bytes: &[u8], first: usize) -> Result<(Vec<u32>, usize), ParseError> {
    let mut ids = Vec::with_capacity(bytes.len() / 6);
    match walk(bytes, first, usize::MAX, &mut ids).map_err(malformed)? {
        After::Close(end) => Ok((ids, end)),
        After::Next(_) => Err(malformed("array does not end")),
    }
}

/// The ids from `first` read as two walks in step: the left one up to the
/// first comma after the middle of `bytes`, the right one from there to `]`.
/// `None` when they do not read a whole array between them.
fn two_walks(bytes: &[u8], first: usize) -> Option<(Vec<u32>, usize)> {
    let split = split_comma(bytes, first + (bytes.len() - first) / 2)?;
    if split <= first {
        return None;
    }
    let mut left = Vec::with_capacity(bytes.len() / 6);
    let mut right = Vec::with_capacity((bytes.len() - split) / 6);
    let (mut left_at, mut right_at) = (first, skip_whitespace(bytes, split + 1));
    let (left_after, right_after) = loop {
        let (left_id, left_end) = read_id(bytes, left_at).ok()?;
        let (right_id, right_end) = read_id(bytes, right_at).ok()?;
        left.push(left_id);
        right.push(right_id);
        match (
            after_id(bytes, left_end).ok()?,
            after_id(bytes, right_end).ok()?,
        ) {
            (After::Next(l), After::Next(r)) if l <= split => (left_at, right_at) = (l, r),
            either_ended => break either_ended,
        }
    };
    let left_after = match left_after {
        After::Next(next) if next <= split => walk(bytes, next, split, &mut left).ok()?,
        other => other,
    };
    if let After::Close(end) = left_after {
        // The array closed before the split: the right walk read past it.
        return Some((left, end));
    }
    let right_after = match right_after {
        After::Next(next) => walk(bytes, next, usize::MAX, &mut right).ok()?,
        closed => closed,
    };
    let After::Close(end) = right_after else {
        return None;
    };
    left.extend_from_slice(&right);
    Some((left, end))
}

/// The first comma at or after `from` with only digits and whitespace
/// before it: in a valid array, a separator between two ids.
fn split_comma(bytes: &[u8], from: usize) -> Option<usize> {
    let offset = bytes.get(from..)?.iter().position(|&byte| {
        !(byte.is_ascii_digit() || matches!(byte, b' ' | b'\n' | b'\r' | b'\t'))
    })?;
    (bytes[from + offset] == b',').then_some(from + offset)
}

/// Reads ids from `at` into `ids` until the array closes or the next id
/// would start after `stop`; what followed the last id read.
fn walk(
    bytes: &[u8],
    mut at: usize,
    stop: usize,
    ids: &mut Vec<u32>,
) -> Result<After, &'static str> {
    loop {
        let (id, end) = read_id(bytes, at)?;
        ids.push(id);
        match after_id(bytes, end)? {
            After::Next(next) if next <= stop => at = next,
            other => return Ok(other),
        }
    }
}

/// The id at `at` and the position after it. Inlined, as is [`after_id`]:
/// left as calls, the two walks took 40 µs for 8,192 ids instead of 31.
#[inline(always)]
fn read_id(bytes: &[u8], at: usize) -> Result<(u32, usize), &'static str> {
    match short_id(bytes, at) {
        Some((id, digits)) => Ok((id, at + digits)),
        None => long_id(bytes, at),
    }
}

/// What follows the id that ends at `end`.
#[inline(always)]
fn after_id(bytes: &[u8], end: usize) -> Result<After, &'static str> {
    let separator = skip_whitespace(bytes, end);
    match bytes.get(separator) {
        Some(b',') => Ok(After::Next(skip_whitespace(bytes, separator + 1))),
        Some(b']') => Ok(After::Close(separator + 1)),
        _ => Err("expected ',' or ']' after an id"),
    }
}

/// The id written at `bytes[start..]`, digit by digit, and the position
/// after it: any length, and every malformed id ([`short_id`] takes the
/// common short ones).
fn long_id(bytes: &[u8], start: usize) -> Result<(u32, usize), &'static str> {
    let mut i = start;
    let mut value: u64 = 0;
    while i < bytes.len() {
        let digit = bytes[i].wrapping_sub(b'0');
        if digit > 9 {
            break;
        }
        value = value * 10 + u64::from(digit);
        if value > u64::from(u32::MAX) {
            return Err("id does not fit in 32 bits");
        }
        i += 1;
    }
    match i - start {
        0 => Err("expected a non-negative integer"),
        1 => Ok((value as u32, i)),
        _ if bytes[start] == b'0' => Err("leading zero"),
        _ => Ok((value as u32, i)),
    }
}

/// The id written at `bytes[at..]` in one to seven digits (no leading zero)
/// and its digit count, read eight bytes at a time; `None` when those eight
/// bytes are not such an id and the next (then the slow path decides).
/// Branch-free over the digits: token ids' lengths vary at random, and a
/// loop's exit mispredicts about once an id.
fn short_id(bytes: &[u8], at: usize) -> Option<(u32, usize)> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let chunk = u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?);
    let values = chunk.wrapping_sub(ONES * u64::from(b'0'));
    // A byte's top bit is set in one of these when it is below '0', above
    // '9' or not ASCII; a borrow or carry only reaches bytes after it.
    let not_digit = (values | chunk.wrapping_add(ONES * 0x46) | chunk) & (ONES * 0x80);
    let digits = (not_digit.trailing_zeros() / 8) as usize;
    if digits == 0 || digits == 8 || (digits > 1 && bytes[at] == b'0') {
        return None;
    }
    // The digits moved to the top bytes (leading zeros below), then summed
    // pairwise: 8 digits make at most 99,999,999, which fits u32.
    let mut v = values << (8 * (8 - digits));
    v = v.wrapping_mul(10).wrapping_add(v >> 8);
    v = ((v & 0x0000_00ff_0000_00ff).wrapping_mul(100 + (1_000_000 << 32))
        + ((v >> 16) & 0x0000_00ff_0000_00ff).wrapping_mul(1 + (10_000 << 32)))
        >> 32;
    Some((v as u32, digits))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::xorshift;

    #[test]
    fn token_id_arrays() {
        assert_eq!(parse_token_ids(b"[]").unwrap(), (vec![], 2));
        assert_eq!(
            parse_token_ids(b" [ 0 ,4294967295\n]x").unwrap(),
            (vec![0, u32::MAX], 18)
        );
        for bad in [
            "",
            "[",
            "[1",
            "[1,]",
            "[,1]",
            "[-1]",
            "[1.5]",
            "[1e3]",
            "[4294967296]",
            "[99999999999999999999999]",
            "[\"1\"]",
            "[01]",
            "[1,007]",
            "1",
        ] {
            assert!(parse_token_ids(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    /// Long arrays, as they come and mutated, read by two walks exactly as
    /// by one (and, when valid, as serde reads them); the two walks must
    /// really be taken.
    #[test]
    fn two_walks_read_as_one_walk_reads() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        let (mut taken, mut valid) = (0, 0);
        for round in 0..3_000 {
            let separator = [",", ", ", " ,\n  "][round % 3];
            let count = 150 + (next() % 600) as usize;
            let ids: Vec<String> = (0..count)
                .map(|_| match next() % 16 {
                    0 => u32::MAX.to_string(),
                    1 => (next() % 10).to_string(),
                    _ => (next() % 200_000).to_string(),
                })
                .collect();
            let tail = [r#"}"#, r#","model":"m7","max_tokens":12}"#, "]"][round % 3];
            let mut body = format!("[{}]{tail}", ids.join(separator)).into_bytes();
            if round % 2 == 1 {
                for _ in 0..1 + next() % 2 {
                    let i = 1 + (next() % (body.len() as u64 - 1)) as usize;
                    body[i] = b"0123456789-.e, ]\n[x"[(next() % 19) as usize];
                }
            }
            let first = skip_whitespace(&body, 1);
            let one = one_walk(&body, first);
            match two_walks(&body, first) {
                Some(two) => {
                    taken += 1;
                    assert_eq!(Ok(&two), one.as_ref(), "{}", String::from_utf8_lossy(&body));
                }
                None => assert!(
                    one.is_err() || round % 2 == 1,
                    "two walks refused a valid array: {}",
                    String::from_utf8_lossy(&body)
                ),
            }
            if let Ok((ids, end)) = &one {
                valid += 1;
                let by_serde: Vec<u32> = serde_json::from_slice(&body[..*end]).unwrap();
                assert_eq!(ids, &by_serde);
            }
            assert_eq!(parse_token_ids(&body).ok(), one.ok());
        }
        assert!(
            taken > 1_500 && valid > 1_500,
            "{taken} taken, {valid} valid"
        );
    }
}
