//! Messages between the VMs of one proxy (worker ↔ worker, worker →
//! singleton, singleton → worker) over Envoy shared queues. Little-endian
//! on [`crate::codec`], length-checked; the decoder never panics. (The
//! workers' load goes through shared data: [`crate::peer_load`].)
//!
//! ```text
//! batch   := u32 count, count × message
//! message := u8 tag, body
//!   'R' Routed:   str pod, u32 n, n × u64 hash
//!   'C' Charged:  str pod, u64 client, u32 blocks
//!   'L' Learned:  str pod, hashes
//!   'U' Unlearned: str pod, hashes
//!   'X' Failed:   str pod
//!   'D' Feed:     u32 len, len bytes of a kvroute_core::feed update
//! hashes  := u32 n, n × u64
//! str     := u16 len, UTF-8
//! ```

use crate::budget::ClientKey;
use crate::codec::{self, CodecError, Reader};
use crate::hash::BlockHash;
use std::fmt;

/// One event a VM tells its peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerMessage {
    /// A request went to `pod`; `hashes` are learned as cached there (the
    /// singleton writes them into the index).
    Routed { pod: String, hashes: Vec<BlockHash> },
    /// `pod` answered a request successfully: its blocks are confirmed
    /// cached there (learned by peers; reported to the indexer).
    Learned { pod: String, hashes: Vec<BlockHash> },
    /// `pod` refused a request: the blocks it was taught are taken back.
    Unlearned { pod: String, hashes: Vec<BlockHash> },
    /// `pod` failed a request (5xx, reset, or served elsewhere).
    Failed { pod: String },
    /// `client` taught `pod` `blocks` of its budget (`tenant_header`): peers
    /// charge it too, so the budget holds for the whole proxy.
    Charged {
        pod: String,
        client: ClientKey,
        blocks: u32,
    },
    /// An indexer feed update, forwarded verbatim by the singleton.
    Feed(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    Truncated,
    UnknownTag(u8),
    BadUtf8,
    TooLong,
    TrailingBytes,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated => write!(f, "peer message truncated"),
            WireError::UnknownTag(t) => write!(f, "peer message has unknown tag {t:#04x}"),
            WireError::BadUtf8 => write!(f, "peer message has a pod name that is not UTF-8"),
            WireError::TooLong => write!(f, "peer message field too long to encode"),
            WireError::TrailingBytes => write!(f, "peer message has bytes after its last message"),
        }
    }
}

impl std::error::Error for WireError {}

const ROUTED: u8 = b'R';
const LEARNED: u8 = b'L';
const CHARGED: u8 = b'C';
const UNLEARNED: u8 = b'U';
const FAILED: u8 = b'X';
const FEED: u8 = b'D';

pub fn encode_batch(messages: &[PeerMessage]) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(64);
    codec::put_u32(&mut out, len_u32(messages.len())?);
    for message in messages {
        match message {
            PeerMessage::Routed { pod, hashes } => {
                out.push(ROUTED);
                put_str(&mut out, pod)?;
                put_hashes(&mut out, hashes)?;
            }
            PeerMessage::Learned { pod, hashes } => {
                out.push(LEARNED);
                put_str(&mut out, pod)?;
                put_hashes(&mut out, hashes)?;
            }
            PeerMessage::Unlearned { pod, hashes } => {
                out.push(UNLEARNED);
                put_str(&mut out, pod)?;
                put_hashes(&mut out, hashes)?;
            }
            PeerMessage::Failed { pod } => {
                out.push(FAILED);
                put_str(&mut out, pod)?;
            }
            PeerMessage::Charged {
                pod,
                client,
                blocks,
            } => {
                out.push(CHARGED);
                put_str(&mut out, pod)?;
                codec::put_u64(&mut out, client.get());
                codec::put_u32(&mut out, *blocks);
            }
            PeerMessage::Feed(bytes) => {
                out.push(FEED);
                codec::put_u32(&mut out, len_u32(bytes.len())?);
                out.extend_from_slice(bytes);
            }
        }
    }
    Ok(out)
}

pub fn decode_batch(bytes: &[u8]) -> Result<Vec<PeerMessage>, WireError> {
    let mut r = Reader::new(bytes);
    let count = r.u32("count")? as usize;
    // Each message takes at least 3 bytes: never trust the count for allocation.
    let mut messages = Vec::with_capacity(count.min(bytes.len() / 3));
    for _ in 0..count {
        let message = match r.u8("tag")? {
            ROUTED => PeerMessage::Routed {
                pod: pod(&mut r)?,
                hashes: hashes(&mut r)?,
            },
            LEARNED => PeerMessage::Learned {
                pod: pod(&mut r)?,
                hashes: hashes(&mut r)?,
            },
            UNLEARNED => PeerMessage::Unlearned {
                pod: pod(&mut r)?,
                hashes: hashes(&mut r)?,
            },
            FAILED => PeerMessage::Failed { pod: pod(&mut r)? },
            CHARGED => PeerMessage::Charged {
                pod: pod(&mut r)?,
                client: ClientKey::new(r.u64("client")?),
                blocks: r.u32("blocks")?,
            },
            FEED => {
                let n = r.u32("feed")? as usize;
                PeerMessage::Feed(r.take(n, "feed")?.to_vec())
            }
            tag => return Err(WireError::UnknownTag(tag)),
        };
        messages.push(message);
    }
    if !r.is_empty() {
        return Err(WireError::TrailingBytes);
    }
    Ok(messages)
}

fn len_u32(n: usize) -> Result<u32, WireError> {
    u32::try_from(n).map_err(|_| WireError::TooLong)
}

fn put_hashes(out: &mut Vec<u8>, hashes: &[BlockHash]) -> Result<(), WireError> {
    codec::put_u32(out, len_u32(hashes.len())?);
    out.reserve(hashes.len() * 8);
    for hash in hashes {
        codec::put_u64(out, hash.get());
    }
    Ok(())
}

pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) -> Result<(), WireError> {
    let len = u16::try_from(s.len()).map_err(|_| WireError::TooLong)?;
    codec::put_u16(out, len);
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

impl From<CodecError> for WireError {
    fn from(e: CodecError) -> WireError {
        match e {
            CodecError::BadUtf8 { .. } => WireError::BadUtf8,
            CodecError::Truncated { .. }
            | CodecError::CountTooLarge { .. }
            | CodecError::BadVarint { .. } => WireError::Truncated,
        }
    }
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<BlockHash>, WireError> {
    let n = r.u32("hashes")?;
    let hashes = r.u64s(n as usize, "hashes")?;
    Ok(hashes.into_iter().map(BlockHash::new).collect())
}

pub(crate) fn pod(r: &mut Reader<'_>) -> Result<String, WireError> {
    let len = r.u16("pod")?;
    Ok(r.str(usize::from(len), "pod")?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::hashes;
    use crate::test_rng::xorshift;

    fn sample() -> Vec<PeerMessage> {
        vec![
            PeerMessage::Routed {
                pod: "10.0.0.1:8000".into(),
                hashes: hashes(&[1, u64::MAX, 0]),
            },
            PeerMessage::Feed(vec![1, 2, 3]),
            PeerMessage::Charged {
                pod: "10.0.0.2:8000".into(),
                client: ClientKey::new(u64::MAX),
                blocks: 40,
            },
            PeerMessage::Routed {
                pod: String::new(),
                hashes: vec![],
            },
            PeerMessage::Learned {
                pod: "10.0.0.4:8000".into(),
                hashes: hashes(&[5, 6]),
            },
            PeerMessage::Unlearned {
                pod: "10.0.0.5:8000".into(),
                hashes: hashes(&[7]),
            },
            PeerMessage::Failed {
                pod: "10.0.0.6:8000".into(),
            },
        ]
    }

    #[test]
    fn round_trip() {
        let bytes = encode_batch(&sample()).unwrap();
        assert_eq!(decode_batch(&bytes).unwrap(), sample());
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        let bytes = encode_batch(&sample()).unwrap();
        for cut in 0..bytes.len() {
            assert!(decode_batch(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut next = xorshift(0x1234_5678);
        for _ in 0..20_000 {
            let mut corrupt = bytes.clone();
            for _ in 0..3 {
                let x = next();
                let i = (x as usize) % corrupt.len();
                corrupt[i] = (x >> 32) as u8;
            }
            let _ = decode_batch(&corrupt);
        }
        assert_eq!(
            decode_batch(&[1, 0, 0, 0, b'Z']),
            Err(WireError::UnknownTag(b'Z'))
        );
        assert_eq!(
            decode_batch(&[255, 255, 255, 255]),
            Err(WireError::Truncated)
        );
    }
}
