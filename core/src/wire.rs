//! Messages between the VMs of one proxy (worker ↔ worker, singleton →
//! worker) over Envoy shared queues. Little-endian, length-checked; the
//! decoder never panics.
//!
//! ```text
//! batch   := u32 count, count × message
//! message := u8 tag, body
//!   'R' Routed:   str pod, u32 prompt_blocks, u32 n, n × u64 hash
//!   'P' PrefillDone: str pod, u32 prompt_blocks
//!   'F' Finished: str pod, u32 prompt_blocks
//!   'A' Released: str pod, u32 prompt_blocks
//!   'L' Learned:  str pod, hashes
//!   'U' Unlearned: str pod, hashes
//!   'X' Failed:   str pod
//!   'D' Feed:     u32 len, len bytes of a kvroute_core::feed update
//! hashes  := u32 n, n × u64
//! str     := u16 len, UTF-8
//! ```

use std::fmt;

/// One event a VM tells its peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerMessage {
    /// A request went to `pod`; `hashes` are learned as cached there.
    Routed {
        pod: String,
        prompt_blocks: u32,
        hashes: Vec<u64>,
    },
    /// A request routed to `pod` got its first response bytes: its prefill
    /// blocks no longer load the pod.
    PrefillDone { pod: String, prompt_blocks: u32 },
    /// A request routed to `pod` ended (its load is released).
    Finished { pod: String, prompt_blocks: u32 },
    /// A request routed to `pod` with `prompt_blocks` uncached blocks ended:
    /// the KV it held there no longer counts as decode pressure.
    Released { pod: String, prompt_blocks: u32 },
    /// `pod` answered a request successfully: its blocks are confirmed
    /// cached there (learned by peers; reported to the indexer).
    Learned { pod: String, hashes: Vec<u64> },
    /// `pod` refused a request: the blocks it was taught are taken back.
    Unlearned { pod: String, hashes: Vec<u64> },
    /// `pod` failed a request (5xx, reset, or served elsewhere).
    Failed { pod: String },
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
const PREFILL_DONE: u8 = b'P';
const FINISHED: u8 = b'F';
const RELEASED: u8 = b'A';
const LEARNED: u8 = b'L';
const UNLEARNED: u8 = b'U';
const FAILED: u8 = b'X';
const FEED: u8 = b'D';

pub fn encode_batch(messages: &[PeerMessage]) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(64);
    put_u32(&mut out, len_u32(messages.len())?);
    for message in messages {
        match message {
            PeerMessage::Routed {
                pod,
                prompt_blocks,
                hashes,
            } => {
                out.push(ROUTED);
                put_str(&mut out, pod)?;
                put_u32(&mut out, *prompt_blocks);
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
            PeerMessage::PrefillDone { pod, prompt_blocks } => {
                out.push(PREFILL_DONE);
                put_str(&mut out, pod)?;
                put_u32(&mut out, *prompt_blocks);
            }
            PeerMessage::Finished { pod, prompt_blocks } => {
                out.push(FINISHED);
                put_str(&mut out, pod)?;
                put_u32(&mut out, *prompt_blocks);
            }
            PeerMessage::Released { pod, prompt_blocks } => {
                out.push(RELEASED);
                put_str(&mut out, pod)?;
                put_u32(&mut out, *prompt_blocks);
            }
            PeerMessage::Feed(bytes) => {
                out.push(FEED);
                put_u32(&mut out, len_u32(bytes.len())?);
                out.extend_from_slice(bytes);
            }
        }
    }
    Ok(out)
}

pub fn decode_batch(bytes: &[u8]) -> Result<Vec<PeerMessage>, WireError> {
    let mut r = Reader { rest: bytes };
    let count = r.u32()? as usize;
    // Each message takes at least 3 bytes: never trust the count for allocation.
    let mut messages = Vec::with_capacity(count.min(bytes.len() / 3));
    for _ in 0..count {
        let message = match r.u8()? {
            ROUTED => PeerMessage::Routed {
                pod: r.str()?,
                prompt_blocks: r.u32()?,
                hashes: r.hashes()?,
            },
            LEARNED => PeerMessage::Learned {
                pod: r.str()?,
                hashes: r.hashes()?,
            },
            UNLEARNED => PeerMessage::Unlearned {
                pod: r.str()?,
                hashes: r.hashes()?,
            },
            FAILED => PeerMessage::Failed { pod: r.str()? },
            PREFILL_DONE => PeerMessage::PrefillDone {
                pod: r.str()?,
                prompt_blocks: r.u32()?,
            },
            FINISHED => PeerMessage::Finished {
                pod: r.str()?,
                prompt_blocks: r.u32()?,
            },
            RELEASED => PeerMessage::Released {
                pod: r.str()?,
                prompt_blocks: r.u32()?,
            },
            FEED => {
                let n = r.u32()? as usize;
                PeerMessage::Feed(r.take(n)?.to_vec())
            }
            tag => return Err(WireError::UnknownTag(tag)),
        };
        messages.push(message);
    }
    if !r.rest.is_empty() {
        return Err(WireError::TrailingBytes);
    }
    Ok(messages)
}

fn len_u32(n: usize) -> Result<u32, WireError> {
    u32::try_from(n).map_err(|_| WireError::TooLong)
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_hashes(out: &mut Vec<u8>, hashes: &[u64]) -> Result<(), WireError> {
    put_u32(out, len_u32(hashes.len())?);
    out.reserve(hashes.len() * 8);
    for hash in hashes {
        out.extend_from_slice(&hash.to_le_bytes());
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) -> Result<(), WireError> {
    let len = u16::try_from(s.len()).map_err(|_| WireError::TooLong)?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.rest.len() {
            return Err(WireError::Truncated);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn hashes(&mut self) -> Result<Vec<u64>, WireError> {
        let n = self.u32()? as usize;
        let raw = self.take(n.checked_mul(8).ok_or(WireError::Truncated)?)?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect())
    }

    fn str(&mut self) -> Result<String, WireError> {
        let mut b = [0u8; 2];
        b.copy_from_slice(self.take(2)?);
        let raw = self.take(u16::from_le_bytes(b) as usize)?;
        String::from_utf8(raw.to_vec()).map_err(|_| WireError::BadUtf8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<PeerMessage> {
        vec![
            PeerMessage::Routed {
                pod: "10.0.0.1:8000".into(),
                prompt_blocks: 3,
                hashes: vec![1, u64::MAX, 0],
            },
            PeerMessage::Finished {
                pod: "10.0.0.2:8000".into(),
                prompt_blocks: 7,
            },
            PeerMessage::Feed(vec![1, 2, 3]),
            PeerMessage::Released {
                pod: "10.0.0.2:8000".into(),
                prompt_blocks: 11,
            },
            PeerMessage::PrefillDone {
                pod: "10.0.0.3:8000".into(),
                prompt_blocks: 9,
            },
            PeerMessage::Routed {
                pod: String::new(),
                prompt_blocks: 0,
                hashes: vec![],
            },
            PeerMessage::Learned {
                pod: "10.0.0.4:8000".into(),
                hashes: vec![5, 6],
            },
            PeerMessage::Unlearned {
                pod: "10.0.0.5:8000".into(),
                hashes: vec![7],
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
        let mut x: u64 = 0x1234_5678;
        for _ in 0..20_000 {
            let mut corrupt = bytes.clone();
            for _ in 0..3 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
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
