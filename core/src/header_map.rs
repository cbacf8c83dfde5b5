//! A header map as the proxy serializes it (proxy-wasm's
//! `proxy_get_header_map_pairs`): one host call hands over every header,
//! where reading them one by one costs a call each.
//!
//! Layout, little-endian: the pair count `n` (u32); `n` pairs of (name
//! length, value length) as u32; then each name and each value in order,
//! each followed by one NUL byte. Reading never panics: a buffer that does
//! not hold what its lengths say is a [`CodecError`].

use crate::codec::{CodecError, Reader};

/// Length fields and NULs of one pair: its least size on the wire.
const MIN_PAIR_BYTES: usize = 10;

/// Headers borrowed from the proxy's buffer, in its order.
#[derive(Debug, Default)]
pub struct HeaderMap<'a> {
    pairs: Vec<(&'a [u8], &'a [u8])>,
}

impl<'a> HeaderMap<'a> {
    pub fn decode(bytes: &'a [u8]) -> Result<HeaderMap<'a>, CodecError> {
        let mut r = Reader::new(bytes);
        let count = r.u32("header count")?;
        let count = r.checked_count(u64::from(count), MIN_PAIR_BYTES, "header")?;
        let mut lengths = Vec::with_capacity(count);
        for _ in 0..count {
            lengths.push((r.u32("header name length")?, r.u32("header value length")?));
        }
        let mut pairs = Vec::with_capacity(count);
        for (name_len, value_len) in lengths {
            let name = r.take(name_len as usize, "header name")?;
            r.take(1, "header name's NUL")?;
            let value = r.take(value_len as usize, "header value")?;
            r.take(1, "header value's NUL")?;
            pairs.push((name, value));
        }
        Ok(HeaderMap { pairs })
    }

    /// The first value of `name` (HTTP names compare ignoring ASCII case);
    /// bytes that are not UTF-8 become U+FFFD, as a client may send them.
    pub fn get(&self, name: &str) -> Option<String> {
        self.pairs
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, value)| String::from_utf8_lossy(value).into_owned())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.pairs
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
    }

    /// Every (name, value), in the proxy's order.
    pub fn pairs(&self) -> &[(&'a [u8], &'a [u8])] {
        &self.pairs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The proxy's serialization of `pairs`.
    fn serialized(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (name, value) in pairs {
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        }
        for (name, value) in pairs {
            out.extend_from_slice(name);
            out.push(0);
            out.extend_from_slice(value);
            out.push(0);
        }
        out
    }

    #[test]
    fn reads_every_pair_and_finds_names_in_any_case() {
        let bytes = serialized(&[
            (b":method", b"POST"),
            (b":path", b"/v1/chat/completions"),
            (b"x-priority", b"low"),
            (b"x-empty", b""),
            (b"x-priority", b"second"),
            (b"x-odd", b"caf\xe9"),
        ]);
        let map = HeaderMap::decode(&bytes).unwrap();
        assert_eq!(map.pairs().len(), 6);
        assert_eq!(map.get(":method").as_deref(), Some("POST"));
        assert_eq!(
            map.get("X-Priority").as_deref(),
            Some("low"),
            "the first value"
        );
        assert_eq!(map.get("x-empty").as_deref(), Some(""));
        assert_eq!(map.get("x-odd").as_deref(), Some("caf\u{fffd}"));
        assert_eq!(map.get("content-length"), None);
        assert!(map.contains("X-EMPTY"));
        assert!(!map.contains("x-kvroute-destination"));
        assert!(HeaderMap::decode(&serialized(&[]))
            .unwrap()
            .pairs()
            .is_empty());
    }

    #[test]
    fn a_buffer_short_of_its_lengths_is_an_error() {
        let bytes = serialized(&[(b"host", b"example"), (b"accept", b"*/*")]);
        for cut in 0..bytes.len() {
            assert!(HeaderMap::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut huge = bytes.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            HeaderMap::decode(&huge),
            Err(CodecError::CountTooLarge { .. })
        ));
        let mut long_value = bytes;
        long_value[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(HeaderMap::decode(&long_value).is_err());
    }
}
