//! The indexer → Envoy feed: a compact little-endian binary codec.
//!
//! Dependency-free (it is linked into the wasm filter). The decoder never
//! panics: every count is checked against the bytes that remain before
//! anything is allocated, and every failure is a typed [`FeedError`].
//!
//! Wire format of a [`FeedUpdate`] (all integers little-endian):
//!
//! ```text
//! magic    "KVRF"                      4 bytes
//! version  u16 = 1
//! flags    u16                         bit 0: snapshot; other bits must be 0
//! epoch    u64
//! cursor   u64
//! n_pods   u32, then n_pods × pod:
//!     address   str                    (str = u32 byte length + UTF-8)
//!     n_models  u32, then n_models × str
//!     capacity_blocks u32, waiting u32, running u32, kv_usage f32 (IEEE-754 bits)
//! n_ops    u32, then n_ops × op:
//!     kind u8, pod u32 (index into pods, checked)
//!     kind 0 Stored:  tier u8 (0 GPU, 1 CPU, 2 disk, 3 learned), n u32, n × u64 hash
//!     kind 1 Removed: n u32, n × u64 hash
//!     kind 2 Cleared: nothing more
//! (no trailing bytes)
//! ```
//!
//! A [`LearnedBatch`] (`POST /v1/learned`):
//!
//! ```text
//! magic "KVRL", version u16 = 1, flags u16 = 0,
//! n_entries u32, then n_entries × (address str, n u32, n × u64 hash)
//! ```
//!
//! Semantics (see docs/contracts.md): `pods` is the complete current pod set
//! (a consumer drops every pod absent from it); `Stored` sets the tier of
//! each (pod, hash) — the best tier the indexer holds for it, replacing any
//! tier sent before; `Removed` drops the (pod, hash) whatever its tier;
//! `Cleared` drops every entry of the pod. A snapshot replaces all state.

use std::fmt;

/// Magic bytes of an encoded [`FeedUpdate`].
pub const FEED_MAGIC: [u8; 4] = *b"KVRF";
/// Magic bytes of an encoded [`LearnedBatch`].
pub const LEARNED_MAGIC: [u8; 4] = *b"KVRL";
/// Wire format version written by this encoder and accepted by the decoder.
pub const VERSION: u16 = 1;

const FLAG_SNAPSHOT: u16 = 1;
const OP_STORED: u8 = 0;
const OP_REMOVED: u8 = 1;
const OP_CLEARED: u8 = 2;
/// Smallest encoded pod: empty address, no models, four u32-sized numbers.
const MIN_POD_BYTES: usize = 4 + 4 + 16;
/// Smallest encoded op: kind + pod.
const MIN_OP_BYTES: usize = 1 + 4;
/// Smallest encoded learned entry: empty address + empty hash list.
const MIN_LEARNED_ENTRY_BYTES: usize = 4 + 4;

/// One answer of `GET /v1/feed`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FeedUpdate {
    /// Identifies the indexer's delta log; changes when the indexer restarts.
    pub epoch: u64,
    /// Position in the delta log after applying this update.
    pub cursor: u64,
    /// True when this update replaces all state instead of extending it.
    pub snapshot: bool,
    /// The complete current pod set; ops refer to pods by index into it.
    pub pods: Vec<PodInfo>,
    /// Block operations, in order.
    pub ops: Vec<BlockOp>,
}

/// A pod as the indexer knows it, with its reported load.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodInfo {
    /// `ip:port`, as written into `x-gateway-destination-endpoint`.
    pub address: String,
    /// Served model names (empty: unknown / every model).
    pub models: Vec<String>,
    /// KV capacity in blocks (0: unknown, use the configured default).
    pub capacity_blocks: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:kv_cache_usage_perc`, a fraction in 0..=1.
    pub kv_usage: f32,
}

/// Where a block is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// In GPU memory (vLLM medium `GPU`, or no medium given).
    Gpu,
    /// Offloaded to CPU memory.
    Cpu,
    /// Offloaded to disk or any other lower medium.
    Disk,
    /// Not reported by the pod: learned from a proxy's routing decision.
    Learned,
}

impl Tier {
    /// Wire code of the tier.
    pub fn code(self) -> u8 {
        match self {
            Tier::Gpu => 0,
            Tier::Cpu => 1,
            Tier::Disk => 2,
            Tier::Learned => 3,
        }
    }

    /// The tier of a wire code.
    pub fn from_code(code: u8) -> Option<Tier> {
        match code {
            0 => Some(Tier::Gpu),
            1 => Some(Tier::Cpu),
            2 => Some(Tier::Disk),
            3 => Some(Tier::Learned),
            _ => None,
        }
    }
}

/// A change to the block index.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockOp {
    /// The pod holds these kvroute block hashes in `tier` (replaces any earlier tier).
    Stored {
        pod: u32,
        tier: Tier,
        hashes: Vec<u64>,
    },
    /// The pod no longer holds these hashes (any tier).
    Removed { pod: u32, hashes: Vec<u64> },
    /// The pod holds nothing.
    Cleared { pod: u32 },
}

impl BlockOp {
    /// Index of the pod the op refers to.
    pub fn pod(&self) -> u32 {
        match self {
            BlockOp::Stored { pod, .. }
            | BlockOp::Removed { pod, .. }
            | BlockOp::Cleared { pod } => *pod,
        }
    }
}

/// Approximate routing decisions of one proxy (`POST /v1/learned`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LearnedBatch {
    /// (pod address, kvroute block hashes routed to it).
    pub entries: Vec<(String, Vec<u64>)>,
}

/// Why a feed or learned message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedError {
    /// The message does not start with the expected magic bytes.
    BadMagic,
    /// A version this decoder does not know.
    UnsupportedVersion(u16),
    /// Flag bits this decoder does not know.
    UnknownFlags(u16),
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
    /// Unknown block-op kind.
    BadOpKind(u8),
    /// Unknown tier code.
    BadTier(u8),
    /// An op names a pod index outside `pods`.
    PodOutOfRange { pod: u32, pods: usize },
    /// Bytes left after the message.
    TrailingBytes(usize),
}

impl fmt::Display for FeedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FeedError::BadMagic => write!(f, "bad magic"),
            FeedError::UnsupportedVersion(v) => write!(f, "unsupported feed version {v}"),
            FeedError::UnknownFlags(x) => write!(f, "unknown flags {x:#06x}"),
            FeedError::Truncated { what } => write!(f, "truncated while reading {what}"),
            FeedError::CountTooLarge {
                what,
                count,
                remaining,
            } => write!(f, "{what} count {count} exceeds the {remaining} bytes left"),
            FeedError::BadUtf8 { what } => write!(f, "{what} is not UTF-8"),
            FeedError::BadOpKind(k) => write!(f, "unknown op kind {k}"),
            FeedError::BadTier(t) => write!(f, "unknown tier {t}"),
            FeedError::PodOutOfRange { pod, pods } => {
                write!(f, "op names pod {pod} of {pods}")
            }
            FeedError::TrailingBytes(n) => write!(f, "{n} trailing bytes"),
        }
    }
}

impl std::error::Error for FeedError {}

// ---------------------------------------------------------------- encoding

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Length as a wire u32; inputs beyond u32::MAX elements are cut to it (the
/// writers below then write only that many, so the output stays decodable).
fn wire_len(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let n = wire_len(s.len());
    put_u32(out, n);
    // A string longer than u32::MAX bytes is cut at a byte boundary that
    // is not checked for UTF-8: such input cannot occur (addresses, model names).
    out.extend_from_slice(s.as_bytes().get(..n as usize).unwrap_or(s.as_bytes()));
}

fn put_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    let n = wire_len(hashes.len());
    put_u32(out, n);
    out.reserve(n as usize * 8);
    for h in hashes.iter().take(n as usize) {
        put_u64(out, *h);
    }
}

/// Exact size of `update` once encoded.
pub fn encoded_len(update: &FeedUpdate) -> usize {
    let pods: usize = update
        .pods
        .iter()
        .map(|p| 4 + p.address.len() + 4 + p.models.iter().map(|m| 4 + m.len()).sum::<usize>() + 16)
        .sum();
    let ops: usize = update
        .ops
        .iter()
        .map(|op| match op {
            BlockOp::Stored { hashes, .. } => 5 + 1 + 4 + 8 * hashes.len(),
            BlockOp::Removed { hashes, .. } => 5 + 4 + 8 * hashes.len(),
            BlockOp::Cleared { .. } => 5,
        })
        .sum();
    4 + 2 + 2 + 8 + 8 + 4 + pods + 4 + ops
}

/// Encodes a feed update.
pub fn encode(update: &FeedUpdate) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len(update));
    out.extend_from_slice(&FEED_MAGIC);
    put_u16(&mut out, VERSION);
    put_u16(&mut out, if update.snapshot { FLAG_SNAPSHOT } else { 0 });
    put_u64(&mut out, update.epoch);
    put_u64(&mut out, update.cursor);
    let n_pods = wire_len(update.pods.len());
    put_u32(&mut out, n_pods);
    for pod in update.pods.iter().take(n_pods as usize) {
        put_str(&mut out, &pod.address);
        let n_models = wire_len(pod.models.len());
        put_u32(&mut out, n_models);
        for m in pod.models.iter().take(n_models as usize) {
            put_str(&mut out, m);
        }
        put_u32(&mut out, pod.capacity_blocks);
        put_u32(&mut out, pod.waiting);
        put_u32(&mut out, pod.running);
        put_u32(&mut out, pod.kv_usage.to_bits());
    }
    let n_ops = wire_len(update.ops.len());
    put_u32(&mut out, n_ops);
    for op in update.ops.iter().take(n_ops as usize) {
        match op {
            BlockOp::Stored { pod, tier, hashes } => {
                out.push(OP_STORED);
                put_u32(&mut out, *pod);
                out.push(tier.code());
                put_hashes(&mut out, hashes);
            }
            BlockOp::Removed { pod, hashes } => {
                out.push(OP_REMOVED);
                put_u32(&mut out, *pod);
                put_hashes(&mut out, hashes);
            }
            BlockOp::Cleared { pod } => {
                out.push(OP_CLEARED);
                put_u32(&mut out, *pod);
            }
        }
    }
    out
}

/// Encodes a learned batch.
pub fn encode_learned(batch: &LearnedBatch) -> Vec<u8> {
    let size: usize = 12
        + batch
            .entries
            .iter()
            .map(|(a, h)| 8 + a.len() + 8 * h.len())
            .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&LEARNED_MAGIC);
    put_u16(&mut out, VERSION);
    put_u16(&mut out, 0);
    let n = wire_len(batch.entries.len());
    put_u32(&mut out, n);
    for (address, hashes) in batch.entries.iter().take(n as usize) {
        put_str(&mut out, address);
        put_hashes(&mut out, hashes);
    }
    out
}

// ---------------------------------------------------------------- decoding

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], FeedError> {
        if n > self.buf.len() {
            return Err(FeedError::Truncated { what });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FeedError> {
        let bytes = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(bytes);
        Ok(a)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, FeedError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, FeedError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, FeedError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, FeedError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Reads a u32 count of items at least `min_item` bytes each, checking
    /// that the remaining input can hold them.
    fn count(&mut self, what: &'static str, min_item: usize) -> Result<usize, FeedError> {
        let n = self.u32(what)?;
        let need = (n as u64).saturating_mul(min_item as u64);
        if need > self.buf.len() as u64 {
            return Err(FeedError::CountTooLarge {
                what,
                count: u64::from(n),
                remaining: self.buf.len(),
            });
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &'static str) -> Result<String, FeedError> {
        let n = self.count(what, 1)?;
        let bytes = self.take(n, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(FeedError::BadUtf8 { what }),
        }
    }

    fn hashes(&mut self) -> Result<Vec<u64>, FeedError> {
        let n = self.count("hashes", 8)?;
        let bytes = self.take(n * 8, "hashes")?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                u64::from_le_bytes(a)
            })
            .collect())
    }

    fn header(&mut self, magic: [u8; 4]) -> Result<u16, FeedError> {
        let m: [u8; 4] = self.array("magic")?;
        if m != magic {
            return Err(FeedError::BadMagic);
        }
        let version = self.u16("version")?;
        if version != VERSION {
            return Err(FeedError::UnsupportedVersion(version));
        }
        self.u16("flags")
    }

    fn finish(&self) -> Result<(), FeedError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FeedError::TrailingBytes(self.buf.len()))
        }
    }
}

/// Decodes a feed update; never panics.
pub fn decode(bytes: &[u8]) -> Result<FeedUpdate, FeedError> {
    let mut r = Reader { buf: bytes };
    let flags = r.header(FEED_MAGIC)?;
    if flags & !FLAG_SNAPSHOT != 0 {
        return Err(FeedError::UnknownFlags(flags));
    }
    let epoch = r.u64("epoch")?;
    let cursor = r.u64("cursor")?;
    let n_pods = r.count("pods", MIN_POD_BYTES)?;
    let mut pods = Vec::with_capacity(n_pods);
    for _ in 0..n_pods {
        let address = r.string("address")?;
        let n_models = r.count("models", 4)?;
        let mut models = Vec::with_capacity(n_models);
        for _ in 0..n_models {
            models.push(r.string("model")?);
        }
        pods.push(PodInfo {
            address,
            models,
            capacity_blocks: r.u32("capacity_blocks")?,
            waiting: r.u32("waiting")?,
            running: r.u32("running")?,
            kv_usage: f32::from_bits(r.u32("kv_usage")?),
        });
    }
    let n_ops = r.count("ops", MIN_OP_BYTES)?;
    let mut ops = Vec::with_capacity(n_ops);
    for _ in 0..n_ops {
        let kind = r.u8("op kind")?;
        let pod = r.u32("op pod")?;
        if pod as usize >= pods.len() {
            return Err(FeedError::PodOutOfRange {
                pod,
                pods: pods.len(),
            });
        }
        let op = match kind {
            OP_STORED => {
                let code = r.u8("tier")?;
                let tier = Tier::from_code(code).ok_or(FeedError::BadTier(code))?;
                BlockOp::Stored {
                    pod,
                    tier,
                    hashes: r.hashes()?,
                }
            }
            OP_REMOVED => BlockOp::Removed {
                pod,
                hashes: r.hashes()?,
            },
            OP_CLEARED => BlockOp::Cleared { pod },
            other => return Err(FeedError::BadOpKind(other)),
        };
        ops.push(op);
    }
    r.finish()?;
    Ok(FeedUpdate {
        epoch,
        cursor,
        snapshot: flags & FLAG_SNAPSHOT != 0,
        pods,
        ops,
    })
}

/// Decodes a learned batch; never panics.
pub fn decode_learned(bytes: &[u8]) -> Result<LearnedBatch, FeedError> {
    let mut r = Reader { buf: bytes };
    let flags = r.header(LEARNED_MAGIC)?;
    if flags != 0 {
        return Err(FeedError::UnknownFlags(flags));
    }
    let n = r.count("learned entries", MIN_LEARNED_ENTRY_BYTES)?;
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let address = r.string("address")?;
        entries.push((address, r.hashes()?));
    }
    r.finish()?;
    Ok(LearnedBatch { entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> FeedUpdate {
        FeedUpdate {
            epoch: 0xdead_beef_0000_0001,
            cursor: 42,
            snapshot: true,
            pods: vec![
                PodInfo {
                    address: "10.0.0.1:8000".into(),
                    models: vec!["Qwen/Qwen3-32B".into(), "lora-a".into()],
                    capacity_blocks: 19208,
                    waiting: 3,
                    running: 17,
                    kv_usage: 0.625,
                },
                PodInfo {
                    address: "10.0.0.2:8000".into(),
                    ..PodInfo::default()
                },
            ],
            ops: vec![
                BlockOp::Stored {
                    pod: 0,
                    tier: Tier::Gpu,
                    hashes: vec![1, u64::MAX, 3],
                },
                BlockOp::Stored {
                    pod: 1,
                    tier: Tier::Learned,
                    hashes: vec![],
                },
                BlockOp::Removed {
                    pod: 0,
                    hashes: vec![u64::MAX],
                },
                BlockOp::Cleared { pod: 1 },
                BlockOp::Stored {
                    pod: 1,
                    tier: Tier::Cpu,
                    hashes: vec![7],
                },
                BlockOp::Stored {
                    pod: 1,
                    tier: Tier::Disk,
                    hashes: vec![8],
                },
            ],
        }
    }

    #[test]
    fn roundtrip_and_exact_length() {
        let u = sample();
        let bytes = encode(&u);
        assert_eq!(bytes.len(), encoded_len(&u));
        assert_eq!(decode(&bytes), Ok(u));
        let empty = FeedUpdate::default();
        let bytes = encode(&empty);
        assert_eq!(bytes.len(), 32);
        assert_eq!(decode(&bytes), Ok(empty));
    }

    /// Pins the byte layout: a change here breaks deployed filters.
    #[test]
    fn layout_vector() {
        let u = FeedUpdate {
            epoch: 1,
            cursor: 2,
            snapshot: false,
            pods: vec![PodInfo {
                address: "a:1".into(),
                models: vec!["m".into()],
                capacity_blocks: 5,
                waiting: 6,
                running: 7,
                kv_usage: 0.5,
            }],
            ops: vec![
                BlockOp::Stored {
                    pod: 0,
                    tier: Tier::Cpu,
                    hashes: vec![0x0102_0304_0506_0708],
                },
                BlockOp::Cleared { pod: 0 },
            ],
        };
        let hex: String = encode(&u).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            concat!(
                "4b565246",
                "0100",
                "0000",
                "0100000000000000",
                "0200000000000000",
                "01000000",
                "03000000",
                "613a31",
                "01000000",
                "01000000",
                "6d",
                "05000000",
                "06000000",
                "07000000",
                "0000003f",
                "02000000",
                "00",
                "00000000",
                "01",
                "01000000",
                "0807060504030201",
                "02",
                "00000000"
            )
        );
        let learned = LearnedBatch {
            entries: vec![("a:1".into(), vec![9])],
        };
        let hex: String = encode_learned(&learned)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            concat!(
                "4b56524c",
                "0100",
                "0000",
                "01000000",
                "03000000",
                "613a31",
                "01000000",
                "0900000000000000"
            )
        );
    }

    #[test]
    fn learned_roundtrip() {
        let b = LearnedBatch {
            entries: vec![
                ("10.0.0.1:8000".into(), vec![1, 2, 3]),
                ("10.0.0.2:8000".into(), vec![]),
            ],
        };
        assert_eq!(decode_learned(&encode_learned(&b)), Ok(b));
        let empty = LearnedBatch::default();
        assert_eq!(decode_learned(&encode_learned(&empty)), Ok(empty));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = encode(&sample());
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "prefix of {n} bytes decoded");
        }
        let learned = encode_learned(&LearnedBatch {
            entries: vec![("x:1".into(), vec![1, 2])],
        });
        for n in 0..learned.len() {
            assert!(decode_learned(&learned[..n]).is_err());
        }
    }

    #[test]
    fn typed_errors() {
        let good = encode(&sample());
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(decode(&b), Err(FeedError::BadMagic));
        let mut b = good.clone();
        b[4] = 2;
        assert_eq!(decode(&b), Err(FeedError::UnsupportedVersion(2)));
        let mut b = good.clone();
        b[6] = 0x81;
        assert_eq!(decode(&b), Err(FeedError::UnknownFlags(0x81)));
        let mut b = good.clone();
        b.push(0);
        assert_eq!(decode(&b), Err(FeedError::TrailingBytes(1)));
        // A huge pod count must be refused before allocating.
        let mut b = good[..24].to_vec();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(&b),
            Err(FeedError::CountTooLarge { what: "pods", .. })
        ));
        // Op naming a pod that does not exist.
        let one_op = FeedUpdate {
            pods: vec![PodInfo::default()],
            ops: vec![BlockOp::Cleared { pod: 0 }],
            ..FeedUpdate::default()
        };
        let mut b = encode(&one_op);
        let n = b.len();
        b[n - 4] = 1;
        assert_eq!(
            decode(&b),
            Err(FeedError::PodOutOfRange { pod: 1, pods: 1 })
        );
        b[n - 4] = 0;
        b[n - 5] = 9;
        assert_eq!(decode(&b), Err(FeedError::BadOpKind(9)));
        let stored = FeedUpdate {
            pods: vec![PodInfo::default()],
            ops: vec![BlockOp::Stored {
                pod: 0,
                tier: Tier::Gpu,
                hashes: vec![],
            }],
            ..FeedUpdate::default()
        };
        let mut b = encode(&stored);
        let n = b.len();
        b[n - 5] = 4;
        assert_eq!(decode(&b), Err(FeedError::BadTier(4)));
        let bad_utf8 = FeedUpdate {
            pods: vec![PodInfo {
                address: "ab".into(),
                ..PodInfo::default()
            }],
            ..FeedUpdate::default()
        };
        let mut b = encode(&bad_utf8);
        b[32] = 0xff;
        assert_eq!(decode(&b), Err(FeedError::BadUtf8 { what: "address" }));
        assert_eq!(decode_learned(&good), Err(FeedError::BadMagic));
    }

    /// Deterministic mutation run: flips, truncations and splices of valid
    /// messages must give an error or a value that re-encodes to the input.
    #[test]
    fn mutations_never_panic_and_roundtrip() {
        let seeds = [encode(&sample()), encode(&FeedUpdate::default())];
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut decoded_ok = 0;
        for i in 0..20_000 {
            let mut b = seeds[i % seeds.len()].clone();
            let edits = 1 + next() % 4;
            for _ in 0..edits {
                let len = b.len().max(1);
                match next() % 4 {
                    0 => {
                        let at = (next() as usize) % len;
                        if let Some(x) = b.get_mut(at) {
                            *x ^= 1 << (next() % 8);
                        }
                    }
                    1 => b.truncate((next() as usize) % len),
                    2 => {
                        let at = (next() as usize) % len;
                        if at <= b.len() {
                            b.insert(at, next() as u8);
                        }
                    }
                    _ => {
                        let at = (next() as usize) % len;
                        if at + 4 <= b.len() {
                            b[at..at + 4].copy_from_slice(&(next() as u32).to_le_bytes());
                        }
                    }
                }
            }
            if let Ok(u) = decode(&b) {
                decoded_ok += 1;
                assert_eq!(encode(&u), b, "decoded value must re-encode to its input");
            }
            let _ = decode_learned(&b);
        }
        assert!(decoded_ok > 0, "mutations should sometimes stay valid");
    }
}
