//! The little-endian byte codec shared by the indexer feed ([`crate::feed`])
//! and the messages between a proxy's VMs ([`crate::wire`]).
//!
//! Writing appends to a `Vec<u8>`; reading never panics and never allocates
//! from an unchecked count: every failure is a [`CodecError`] naming what was
//! being read. Varints are unsigned LEB128 and must be minimal (one encoding
//! per value, so whatever decodes re-encodes to the same bytes).

use std::fmt;

/// Bytes of an index key on the wire (see [`crate::hash::INDEX_KEY_BITS`]).
pub const KEY_BYTES: usize = 5;

/// Why bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CodecError {
    /// The input ended while reading `what`.
    Truncated { what: &'static str },
    /// A count larger than the remaining input could hold.
    CountTooLarge {
        what: &'static str,
        count: u64,
        remaining: usize,
    },
    /// A string that is not UTF-8.
    BadUtf8 { what: &'static str },
    /// A varint longer than its value needs, or beyond 64 bits.
    BadVarint { what: &'static str },
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecError::Truncated { what } => write!(f, "truncated while reading {what}"),
            CodecError::CountTooLarge {
                what,
                count,
                remaining,
            } => write!(f, "{what} count {count} exceeds the {remaining} bytes left"),
            CodecError::BadUtf8 { what } => write!(f, "{what} is not UTF-8"),
            CodecError::BadVarint { what } => write!(f, "{what} is not a minimal varint"),
        }
    }
}

impl std::error::Error for CodecError {}

// ---------------------------------------------------------------- writing

pub fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Unsigned LEB128: 7 bits per byte, low bits first.
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Bytes [`put_varint`] writes for `v`.
pub fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

// ---------------------------------------------------------------- reading

/// A cursor over bytes being decoded.
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { rest: bytes }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], CodecError> {
        if n > self.rest.len() {
            return Err(CodecError::Truncated { what });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], CodecError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, CodecError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub fn u16(&mut self, what: &'static str) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub fn u32(&mut self, what: &'static str) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn u64(&mut self, what: &'static str) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub fn varint(&mut self, what: &'static str) -> Result<u64, CodecError> {
        let mut v = 0u64;
        for i in 0..10 {
            let byte = self.u8(what)?;
            let bits = u64::from(byte & 0x7f);
            // The tenth byte may carry only the 64th bit.
            if i == 9 && bits > 1 {
                return Err(CodecError::BadVarint { what });
            }
            v |= bits << (7 * i);
            if byte & 0x80 == 0 {
                // A last byte of 0 after others would be a longer encoding of a smaller value.
                if byte == 0 && i > 0 {
                    return Err(CodecError::BadVarint { what });
                }
                return Ok(v);
            }
        }
        Err(CodecError::BadVarint { what })
    }

    /// `count` checked against the input left: items are at least `min_item` bytes each.
    pub fn checked_count(
        &self,
        count: u64,
        min_item: usize,
        what: &'static str,
    ) -> Result<usize, CodecError> {
        let need = count.saturating_mul(min_item as u64);
        match usize::try_from(count) {
            Ok(n) if need <= self.rest.len() as u64 => Ok(n),
            _ => Err(CodecError::CountTooLarge {
                what,
                count,
                remaining: self.rest.len(),
            }),
        }
    }

    /// `len` bytes of UTF-8.
    pub fn str(&mut self, len: usize, what: &'static str) -> Result<String, CodecError> {
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| CodecError::BadUtf8 { what })
    }

    /// `n` little-endian u64s.
    pub fn u64s(&mut self, n: usize, what: &'static str) -> Result<Vec<u64>, CodecError> {
        let n = self.checked_count(n as u64, 8, what)?;
        Ok(self
            .take(n * 8, what)?
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                u64::from_le_bytes(a)
            })
            .collect())
    }

    /// True when every byte was read.
    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_roundtrip_with_their_predicted_length() {
        for v in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len(), varint_len(v), "{v}");
            let mut r = Reader::new(&out);
            assert_eq!(r.varint("v"), Ok(v));
            assert!(r.is_empty());
        }
    }

    #[test]
    fn non_minimal_or_oversized_varints_are_refused() {
        let bad = CodecError::BadVarint { what: "v" };
        // 0 written in two bytes; 1 written in two bytes.
        assert_eq!(Reader::new(&[0x80, 0x00]).varint("v"), Err(bad.clone()));
        assert_eq!(Reader::new(&[0x81, 0x00]).varint("v"), Err(bad.clone()));
        // Eleven bytes, and a tenth byte carrying more than bit 64.
        assert_eq!(Reader::new(&[0xff; 11]).varint("v"), Err(bad.clone()));
        let mut over = vec![0xff; 9];
        over.push(0x02);
        assert_eq!(Reader::new(&over).varint("v"), Err(bad));
        assert_eq!(
            Reader::new(&[0x80]).varint("v"),
            Err(CodecError::Truncated { what: "v" })
        );
    }

    #[test]
    fn counts_beyond_the_input_are_refused_before_allocating() {
        let r = Reader::new(&[0; 9]);
        assert_eq!(r.checked_count(1, 8, "x"), Ok(1));
        assert_eq!(
            r.checked_count(u64::MAX, 1, "x"),
            Err(CodecError::CountTooLarge {
                what: "x",
                count: u64::MAX,
                remaining: 9
            })
        );
        let mut r = Reader::new(&[0xff, 0xfe]);
        assert_eq!(r.str(2, "s"), Err(CodecError::BadUtf8 { what: "s" }));
        assert_eq!(
            Reader::new(&[1, 2]).u32("n"),
            Err(CodecError::Truncated { what: "n" })
        );
    }
}
