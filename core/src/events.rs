//! vLLM KV-cache events, decoded from the ZMQ payload (msgpack).
//!
//! Both encodings vLLM has used are accepted (see `vllm-kv-events.md`):
//! map-encoded events (vLLM ≥ 0.26, `{"type": "BlockStored", ...}`) and
//! positional arrays (vLLM ≤ 0.20, `["BlockStored", hashes, parent, ...]`),
//! inside a batch `[ts, events]` or `[ts, events, data_parallel_rank]`.
//! Block hashes may be unsigned ints (u64), signed ints (older builds, read as
//! the same 64 bits) or byte strings (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`,
//! 32-byte digests), folded to a u64 by [`fold_hash_bytes`]. Unknown fields
//! are skipped; unknown event types decode to [`KvEvent::Unknown`].
//!
//! The decoder is a small bounds-checked msgpack reader of its own (no
//! dependency, no allocation beyond the decoded values): it never panics,
//! refuses any count larger than the remaining input could hold before
//! allocating, limits nesting depth, and reports a typed [`EventError`].

use std::fmt;

use crate::feed::Tier;

/// Deepest nesting skipped inside an unknown field.
const MAX_DEPTH: usize = 32;

/// One ZMQ message payload: a batch of events from one publisher.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Publisher timestamp (seconds since the epoch).
    pub ts: f64,
    /// Events in publication order.
    pub events: Vec<KvEvent>,
    /// vLLM data-parallel rank of the engine that published the batch.
    pub data_parallel_rank: Option<i64>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks were filled and are now cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
    /// An event type this decoder does not know (kept so it can be counted).
    Unknown { tag: String },
}

/// A `BlockStored` event.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// vLLM's hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<u64>,
    /// vLLM's hash of the block preceding the first one; `None` at the root.
    pub parent_block_hash: Option<u64>,
    /// Tokens of all stored blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// LoRA adapter id, when the request used one.
    pub lora_id: Option<i64>,
    /// Storage medium (`None`: GPU).
    pub medium: Option<Medium>,
    /// LoRA adapter name (vLLM ≥ 0.26).
    pub lora_name: Option<String>,
    /// KV-cache group (hybrid models).
    pub group_idx: Option<i64>,
}

/// A `BlockRemoved` event.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// vLLM's hashes of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// Storage medium the blocks were removed from (`None`: GPU).
    pub medium: Option<Medium>,
    /// KV-cache group (hybrid models).
    pub group_idx: Option<i64>,
}

/// vLLM storage medium of a block.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    /// `"GPU"`.
    Gpu,
    /// `"CPU"`.
    Cpu,
    /// Any other medium name (disk, remote stores…), as sent.
    Other(String),
}

impl Medium {
    fn parse(name: &str) -> Medium {
        if name.eq_ignore_ascii_case("GPU") {
            Medium::Gpu
        } else if name.eq_ignore_ascii_case("CPU") {
            Medium::Cpu
        } else {
            Medium::Other(name.to_owned())
        }
    }

    /// The feed tier of a medium: GPU (or no medium) → `Gpu`, CPU → `Cpu`,
    /// anything else → `Disk`.
    pub fn tier(medium: Option<&Medium>) -> Tier {
        match medium {
            None | Some(Medium::Gpu) => Tier::Gpu,
            Some(Medium::Cpu) => Tier::Cpu,
            Some(Medium::Other(_)) => Tier::Disk,
        }
    }
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventError {
    /// The input ended inside a value.
    Truncated,
    /// A byte that starts no msgpack value (0xc1).
    InvalidMarker(u8),
    /// A value of the wrong type.
    UnexpectedType {
        what: &'static str,
        found: &'static str,
    },
    /// An array/map/string count larger than the remaining input.
    CountTooLarge { what: &'static str, count: u64 },
    /// Nesting deeper than the decoder follows.
    TooDeep,
    /// A string that is not UTF-8.
    BadUtf8 { what: &'static str },
    /// An integer outside the range of its field.
    OutOfRange { what: &'static str },
    /// A batch or event without a required element.
    MissingField {
        event: &'static str,
        field: &'static str,
    },
    /// Bytes left after the batch.
    TrailingBytes(usize),
    /// A sequence frame that is not 8 bytes.
    BadSeqFrame(usize),
}

impl fmt::Display for EventError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventError::Truncated => write!(f, "truncated msgpack"),
            EventError::InvalidMarker(b) => write!(f, "invalid msgpack marker {b:#04x}"),
            EventError::UnexpectedType { what, found } => {
                write!(f, "{what}: unexpected {found}")
            }
            EventError::CountTooLarge { what, count } => {
                write!(f, "{what}: count {count} exceeds the input")
            }
            EventError::TooDeep => write!(f, "nesting too deep"),
            EventError::BadUtf8 { what } => write!(f, "{what}: not UTF-8"),
            EventError::OutOfRange { what } => write!(f, "{what}: integer out of range"),
            EventError::MissingField { event, field } => {
                write!(f, "{event}: missing {field}")
            }
            EventError::TrailingBytes(n) => write!(f, "{n} trailing bytes after the batch"),
            EventError::BadSeqFrame(n) => write!(f, "sequence frame of {n} bytes, expected 8"),
        }
    }
}

impl std::error::Error for EventError {}

impl EventError {
    /// Short stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            EventError::Truncated => "truncated",
            EventError::InvalidMarker(_) => "invalid_marker",
            EventError::UnexpectedType { .. } => "unexpected_type",
            EventError::CountTooLarge { .. } => "count_too_large",
            EventError::TooDeep => "too_deep",
            EventError::BadUtf8 { .. } => "bad_utf8",
            EventError::OutOfRange { .. } => "out_of_range",
            EventError::MissingField { .. } => "missing_field",
            EventError::TrailingBytes(_) => "trailing_bytes",
            EventError::BadSeqFrame(_) => "bad_seq_frame",
        }
    }
}

/// Folds a byte-string block hash to a u64: the last 8 bytes read big-endian
/// (zero-padded on the left when shorter). vLLM's int form is the low 8 bytes
/// of the same digest, so both forms of one block fold to the same value.
pub fn fold_hash_bytes(bytes: &[u8]) -> u64 {
    let tail = if bytes.len() > 8 {
        &bytes[bytes.len() - 8..]
    } else {
        bytes
    };
    tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
}

/// Decodes the 8-byte big-endian sequence frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, EventError> {
    let a: [u8; 8] = frame
        .try_into()
        .map_err(|_| EventError::BadSeqFrame(frame.len()))?;
    Ok(u64::from_be_bytes(a))
}

/// Pod identity carried in a topic `kv@<ip:port>@<model>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicIdentity {
    /// `ip:port` of the pod's HTTP server.
    pub address: String,
    /// Served model name (may be empty).
    pub model: String,
}

/// Parses the topic convention `kv@<ip:port>@<model>`; `None` for any
/// other topic (e.g. vLLM's default empty topic or `kv@dp0`). The address
/// must look like `host:port` (port digits; `[v6]:port` accepted); the model
/// is everything after the second `@` (model names may contain `@`).
pub fn parse_topic(topic: &str) -> Option<TopicIdentity> {
    let rest = topic.strip_prefix("kv@")?;
    let (address, model) = match rest.split_once('@') {
        Some((a, m)) => (a, m),
        None => (rest, ""),
    };
    let (host, port) = address.rsplit_once(':')?;
    if host.is_empty() || port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if port.parse::<u16>().is_err() {
        return None;
    }
    Some(TopicIdentity {
        address: address.to_owned(),
        model: model.to_owned(),
    })
}

// ------------------------------------------------------------ msgpack reader

struct Reader<'a> {
    buf: &'a [u8],
}

/// A scalar read where a hash, int or nil is allowed.
enum Scalar {
    Nil,
    Uint(u64),
    Int(i64),
    Bin(u64),
}

fn type_name(marker: u8) -> &'static str {
    match marker {
        0x00..=0x7f | 0xcc..=0xcf | 0xd0..=0xd3 | 0xe0..=0xff => "int",
        0x80..=0x8f | 0xde | 0xdf => "map",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xc0 => "nil",
        0xc2 | 0xc3 => "bool",
        0xc4..=0xc6 => "bin",
        0xc7..=0xc9 | 0xd4..=0xd8 => "ext",
        0xca | 0xcb => "float",
        _ => "invalid",
    }
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Result<u8, EventError> {
        self.buf.first().copied().ok_or(EventError::Truncated)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], EventError> {
        if n > self.buf.len() {
            return Err(EventError::Truncated);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn byte(&mut self) -> Result<u8, EventError> {
        let b = self.peek()?;
        self.buf = &self.buf[1..];
        Ok(b)
    }

    fn be(&mut self, n: usize) -> Result<u64, EventError> {
        Ok(match n {
            1 => u64::from(self.arr::<1>()?[0]),
            2 => u64::from(u16::from_be_bytes(self.arr()?)),
            4 => u64::from(u32::from_be_bytes(self.arr()?)),
            8 => u64::from_be_bytes(self.arr()?),
            _ => self
                .take(n)?
                .iter()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)),
        })
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], EventError> {
        match self.buf.split_first_chunk::<N>() {
            Some((head, tail)) => {
                self.buf = tail;
                Ok(*head)
            }
            None => Err(EventError::Truncated),
        }
    }

    /// Checks that `count` items of at least `min_item` bytes each fit.
    fn fits(&self, what: &'static str, count: u64, min_item: u64) -> Result<usize, EventError> {
        if count.saturating_mul(min_item) > self.buf.len() as u64 {
            return Err(EventError::CountTooLarge { what, count });
        }
        usize::try_from(count).map_err(|_| EventError::CountTooLarge { what, count })
    }

    fn unexpected(&self, what: &'static str) -> EventError {
        match self.buf.first() {
            None => EventError::Truncated,
            Some(&m) => EventError::UnexpectedType {
                what,
                found: type_name(m),
            },
        }
    }

    fn is_nil(&self) -> bool {
        self.buf.first() == Some(&0xc0)
    }

    fn array_len(&mut self, what: &'static str) -> Result<usize, EventError> {
        self.container_len(what, 0x90, 0xdc, 0xdd, 1)
    }

    fn map_len(&mut self, what: &'static str) -> Result<usize, EventError> {
        self.container_len(what, 0x80, 0xde, 0xdf, 2)
    }

    /// A msgpack array or map header: the fix form (`fix` plus a count up
    /// to 15), or a 16- or 32-bit count after its marker byte. Each item
    /// takes at least `min_item_bytes`, which bounds the count by the input.
    fn container_len(
        &mut self,
        what: &'static str,
        fix: u8,
        wide16: u8,
        wide32: u8,
        min_item_bytes: u64,
    ) -> Result<usize, EventError> {
        let m = self.peek()?;
        let width = match m {
            _ if (fix..=fix | 0x0f).contains(&m) => 0,
            _ if m == wide16 => 2,
            _ if m == wide32 => 4,
            _ => return Err(self.unexpected(what)),
        };
        self.buf = &self.buf[1..];
        let n = if width == 0 {
            u64::from(m & 0x0f)
        } else {
            self.be(width)?
        };
        self.fits(what, n, min_item_bytes)
    }

    fn str_bytes(&mut self, what: &'static str) -> Result<&'a [u8], EventError> {
        let m = self.peek()?;
        let n = match m {
            0xa0..=0xbf => {
                self.buf = &self.buf[1..];
                u64::from(m & 0x1f)
            }
            0xd9 => {
                self.buf = &self.buf[1..];
                self.be(1)?
            }
            0xda => {
                self.buf = &self.buf[1..];
                self.be(2)?
            }
            0xdb => {
                self.buf = &self.buf[1..];
                self.be(4)?
            }
            _ => return Err(self.unexpected(what)),
        };
        let n = self.fits(what, n, 1)?;
        self.take(n)
    }

    fn string(&mut self, what: &'static str) -> Result<&'a str, EventError> {
        let bytes = self.str_bytes(what)?;
        std::str::from_utf8(bytes).map_err(|_| EventError::BadUtf8 { what })
    }

    fn bin_bytes(&mut self, what: &'static str) -> Result<&'a [u8], EventError> {
        let m = self.byte()?;
        let n = match m {
            0xc4 => self.be(1)?,
            0xc5 => self.be(2)?,
            0xc6 => self.be(4)?,
            _ => {
                return Err(EventError::UnexpectedType {
                    what,
                    found: type_name(m),
                })
            }
        };
        let n = self.fits(what, n, 1)?;
        self.take(n)
    }

    fn scalar(&mut self, what: &'static str) -> Result<Scalar, EventError> {
        let m = self.peek()?;
        Ok(match m {
            0x00..=0x7f => {
                self.buf = &self.buf[1..];
                Scalar::Uint(u64::from(m))
            }
            0xe0..=0xff => {
                self.buf = &self.buf[1..];
                Scalar::Int(i64::from(m as i8))
            }
            0xc0 => {
                self.buf = &self.buf[1..];
                Scalar::Nil
            }
            0xcc => {
                self.buf = &self.buf[1..];
                Scalar::Uint(self.be(1)?)
            }
            0xcd => {
                self.buf = &self.buf[1..];
                Scalar::Uint(self.be(2)?)
            }
            0xce => {
                self.buf = &self.buf[1..];
                Scalar::Uint(self.be(4)?)
            }
            0xcf => {
                self.buf = &self.buf[1..];
                Scalar::Uint(self.be(8)?)
            }
            0xd0 => {
                self.buf = &self.buf[1..];
                Scalar::Int(i64::from(self.be(1)? as u8 as i8))
            }
            0xd1 => {
                self.buf = &self.buf[1..];
                Scalar::Int(i64::from(self.be(2)? as u16 as i16))
            }
            0xd2 => {
                self.buf = &self.buf[1..];
                Scalar::Int(i64::from(self.be(4)? as u32 as i32))
            }
            0xd3 => {
                self.buf = &self.buf[1..];
                Scalar::Int(self.be(8)? as i64)
            }
            0xc4..=0xc6 => Scalar::Bin(fold_hash_bytes(self.bin_bytes(what)?)),
            _ => return Err(self.unexpected(what)),
        })
    }

    /// A block hash: u64, i64 (same 64 bits) or bytes (folded).
    fn hash(&mut self, what: &'static str) -> Result<u64, EventError> {
        match self.scalar(what)? {
            Scalar::Uint(v) | Scalar::Bin(v) => Ok(v),
            Scalar::Int(v) => Ok(v as u64),
            Scalar::Nil => Err(EventError::UnexpectedType { what, found: "nil" }),
        }
    }

    fn opt_hash(&mut self, what: &'static str) -> Result<Option<u64>, EventError> {
        if self.is_nil() {
            self.buf = &self.buf[1..];
            return Ok(None);
        }
        self.hash(what).map(Some)
    }

    fn int(&mut self, what: &'static str) -> Result<i64, EventError> {
        match self.scalar(what)? {
            Scalar::Uint(v) => i64::try_from(v).map_err(|_| EventError::OutOfRange { what }),
            Scalar::Int(v) => Ok(v),
            Scalar::Nil => Err(EventError::UnexpectedType { what, found: "nil" }),
            Scalar::Bin(_) => Err(EventError::UnexpectedType { what, found: "bin" }),
        }
    }

    fn opt_int(&mut self, what: &'static str) -> Result<Option<i64>, EventError> {
        if self.is_nil() {
            self.buf = &self.buf[1..];
            return Ok(None);
        }
        self.int(what).map(Some)
    }

    fn opt_string(&mut self, what: &'static str) -> Result<Option<&'a str>, EventError> {
        if self.is_nil() {
            self.buf = &self.buf[1..];
            return Ok(None);
        }
        self.string(what).map(Some)
    }

    fn float(&mut self, what: &'static str) -> Result<f64, EventError> {
        let m = self.peek()?;
        match m {
            0xca => {
                self.buf = &self.buf[1..];
                Ok(f64::from(f32::from_bits(self.be(4)? as u32)))
            }
            0xcb => {
                self.buf = &self.buf[1..];
                Ok(f64::from_bits(self.be(8)?))
            }
            _ => match self.scalar(what)? {
                Scalar::Uint(v) => Ok(v as f64),
                Scalar::Int(v) => Ok(v as f64),
                Scalar::Nil => Ok(0.0),
                Scalar::Bin(_) => Err(EventError::UnexpectedType { what, found: "bin" }),
            },
        }
    }

    fn hashes(&mut self, what: &'static str) -> Result<Vec<u64>, EventError> {
        let n = self.array_len(what)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.hash(what)?);
        }
        Ok(out)
    }

    fn tokens(&mut self) -> Result<Vec<u32>, EventError> {
        const WHAT: &str = "token_ids";
        let n = self.array_len(WHAT)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let m = self.peek()?;
            // Fast paths for the encodings token ids take (positive fixint, uint 8/16/32).
            let t = if m <= 0x7f {
                self.buf = &self.buf[1..];
                u32::from(m)
            } else if m == 0xcd {
                self.buf = &self.buf[1..];
                u32::from(u16::from_be_bytes(self.arr()?))
            } else if m == 0xce {
                self.buf = &self.buf[1..];
                u32::from_be_bytes(self.arr()?)
            } else if m == 0xcc {
                self.buf = &self.buf[1..];
                u32::from(self.arr::<1>()?[0])
            } else {
                match self.scalar(WHAT)? {
                    Scalar::Uint(v) => {
                        u32::try_from(v).map_err(|_| EventError::OutOfRange { what: WHAT })?
                    }
                    Scalar::Int(v) => {
                        u32::try_from(v).map_err(|_| EventError::OutOfRange { what: WHAT })?
                    }
                    Scalar::Nil => {
                        return Err(EventError::UnexpectedType {
                            what: WHAT,
                            found: "nil",
                        })
                    }
                    Scalar::Bin(_) => {
                        return Err(EventError::UnexpectedType {
                            what: WHAT,
                            found: "bin",
                        })
                    }
                }
            };
            out.push(t);
        }
        Ok(out)
    }

    fn medium(&mut self) -> Result<Option<Medium>, EventError> {
        Ok(self.opt_string("medium")?.map(Medium::parse))
    }

    /// Skips one value of any type.
    fn skip(&mut self, depth: usize) -> Result<(), EventError> {
        if depth > MAX_DEPTH {
            return Err(EventError::TooDeep);
        }
        let m = self.peek()?;
        match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => {
                self.buf = &self.buf[1..];
            }
            0x80..=0x8f | 0xde | 0xdf => {
                let n = self.map_len("skipped map")?;
                for _ in 0..n * 2 {
                    self.skip(depth + 1)?;
                }
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let n = self.array_len("skipped array")?;
                for _ in 0..n {
                    self.skip(depth + 1)?;
                }
            }
            0xa0..=0xbf | 0xd9..=0xdb => {
                self.str_bytes("skipped str")?;
            }
            0xc4..=0xc6 => {
                self.bin_bytes("skipped bin")?;
            }
            0xca => {
                self.take(5)?;
            }
            0xcb => {
                self.take(9)?;
            }
            0xcc..=0xd3 => {
                let width = 1usize << (m & 0x03);
                self.take(1 + width)?;
            }
            0xd4..=0xd8 => {
                let width = 1usize << (m - 0xd4);
                self.take(2 + width)?;
            }
            0xc7..=0xc9 => {
                self.buf = &self.buf[1..];
                let len = self.be(1usize << (m - 0xc7))?;
                let n = self.fits("skipped ext", len, 1)?;
                self.take(1 + n)?;
            }
            _ => return Err(EventError::InvalidMarker(m)),
        }
        Ok(())
    }
}

// ------------------------------------------------------------------ events

/// Decodes one ZMQ payload (the third frame) into a batch; never panics.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, EventError> {
    let mut r = Reader { buf: payload };
    let n = r.array_len("batch")?;
    if n < 2 {
        return Err(EventError::MissingField {
            event: "batch",
            field: "events",
        });
    }
    let ts = r.float("ts")?;
    let count = r.array_len("events")?;
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        events.push(decode_event(&mut r)?);
    }
    let mut data_parallel_rank = None;
    if n >= 3 {
        data_parallel_rank = r.opt_int("data_parallel_rank")?;
    }
    for _ in 3..n {
        r.skip(1)?;
    }
    if !r.buf.is_empty() {
        return Err(EventError::TrailingBytes(r.buf.len()));
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn decode_event(r: &mut Reader<'_>) -> Result<KvEvent, EventError> {
    match r.peek()? {
        0x80..=0x8f | 0xde | 0xdf => decode_map_event(r),
        0x90..=0x9f | 0xdc | 0xdd => decode_array_event(r),
        _ => Err(r.unexpected("event")),
    }
}

/// Fields of a map-encoded event, gathered before the type is known.
#[derive(Default)]
struct MapFields<'a> {
    tag: Option<&'a str>,
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<i64>,
    lora_id: Option<i64>,
    medium: Option<Medium>,
    lora_name: Option<&'a str>,
    group_idx: Option<i64>,
}

fn decode_map_event(r: &mut Reader<'_>) -> Result<KvEvent, EventError> {
    let n = r.map_len("event")?;
    let mut f = MapFields::default();
    for _ in 0..n {
        let key = r.str_bytes("event key")?;
        match key {
            b"type" => f.tag = Some(r.string("type")?),
            b"block_hashes" => f.block_hashes = Some(r.hashes("block_hashes")?),
            b"parent_block_hash" => f.parent_block_hash = r.opt_hash("parent_block_hash")?,
            b"token_ids" => f.token_ids = Some(r.tokens()?),
            b"block_size" => f.block_size = r.opt_int("block_size")?,
            b"lora_id" => f.lora_id = r.opt_int("lora_id")?,
            b"medium" => f.medium = r.medium()?,
            b"lora_name" => f.lora_name = r.opt_string("lora_name")?,
            b"group_idx" => f.group_idx = r.opt_int("group_idx")?,
            _ => r.skip(2)?,
        }
    }
    let tag = f.tag.ok_or(EventError::MissingField {
        event: "event",
        field: "type",
    })?;
    Ok(match tag {
        "BlockStored" => {
            let missing = |field| EventError::MissingField {
                event: "BlockStored",
                field,
            };
            KvEvent::BlockStored(BlockStored {
                block_hashes: f.block_hashes.ok_or(missing("block_hashes"))?,
                parent_block_hash: f.parent_block_hash,
                token_ids: f.token_ids.ok_or(missing("token_ids"))?,
                block_size: block_size(f.block_size.ok_or(missing("block_size"))?)?,
                lora_id: f.lora_id,
                medium: f.medium,
                lora_name: f.lora_name.map(str::to_owned),
                group_idx: f.group_idx,
            })
        }
        "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: f.block_hashes.ok_or(EventError::MissingField {
                event: "BlockRemoved",
                field: "block_hashes",
            })?,
            medium: f.medium,
            group_idx: f.group_idx,
        }),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => KvEvent::Unknown {
            tag: other.to_owned(),
        },
    })
}

fn block_size(v: i64) -> Result<u32, EventError> {
    u32::try_from(v)
        .ok()
        .filter(|&b| b > 0)
        .ok_or(EventError::OutOfRange { what: "block_size" })
}

fn decode_array_event(r: &mut Reader<'_>) -> Result<KvEvent, EventError> {
    let n = r.array_len("event")?;
    if n == 0 {
        return Err(EventError::MissingField {
            event: "event",
            field: "type",
        });
    }
    let tag = r.string("type")?;
    // Elements read so far (the tag).
    let mut used = 1;
    let event = match tag {
        "BlockStored" => {
            if n < 5 {
                return Err(EventError::MissingField {
                    event: "BlockStored",
                    field: "block_size",
                });
            }
            let block_hashes = r.hashes("block_hashes")?;
            let parent_block_hash = r.opt_hash("parent_block_hash")?;
            let token_ids = r.tokens()?;
            let block_size = block_size(r.int("block_size")?)?;
            used = 5;
            let mut e = BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ..BlockStored::default()
            };
            if n > 5 {
                e.lora_id = r.opt_int("lora_id")?;
                used = 6;
            }
            if n > 6 {
                e.medium = r.medium()?;
                used = 7;
            }
            if n > 7 {
                e.lora_name = r.opt_string("lora_name")?.map(str::to_owned);
                used = 8;
            }
            if n > 9 {
                r.skip(2)?; // extra_keys
                e.group_idx = r.opt_int("group_idx")?;
                used = 10;
            }
            KvEvent::BlockStored(e)
        }
        "BlockRemoved" => {
            if n < 2 {
                return Err(EventError::MissingField {
                    event: "BlockRemoved",
                    field: "block_hashes",
                });
            }
            let mut e = BlockRemoved {
                block_hashes: r.hashes("block_hashes")?,
                ..BlockRemoved::default()
            };
            used = 2;
            if n > 2 {
                e.medium = r.medium()?;
                used = 3;
            }
            if n > 3 {
                e.group_idx = r.opt_int("group_idx")?;
                used = 4;
            }
            KvEvent::BlockRemoved(e)
        }
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => KvEvent::Unknown {
            tag: other.to_owned(),
        },
    };
    for _ in used..n {
        r.skip(2)?;
    }
    Ok(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_matches_int_form() {
        // From the golden captures: the int hash is the low 8 bytes of the digest.
        let digest = [
            0xfe, 0x8f, 0xa5, 0xdd, 0xa3, 0x21, 0x0d, 0x0c, 0xa2, 0x03, 0x1e, 0x37, 0xcb, 0xe3,
            0xb0, 0x01, 0x18, 0x67, 0x73, 0xcd, 0x1c, 0x71, 0x0b, 0xeb, 0x2d, 0x45, 0xfc, 0xb5,
            0x1d, 0x43, 0x47, 0x98,
        ];
        assert_eq!(fold_hash_bytes(&digest), 3_262_291_359_910_021_016);
        assert_eq!(fold_hash_bytes(&[1, 2]), 0x0102);
        assert_eq!(fold_hash_bytes(&[]), 0);
    }

    #[test]
    fn seq_frames() {
        assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Ok(258));
        assert_eq!(decode_seq(&[0xff; 8]), Ok(u64::MAX));
        assert_eq!(decode_seq(&[1, 2, 3]), Err(EventError::BadSeqFrame(3)));
    }

    #[test]
    fn topics() {
        assert_eq!(
            parse_topic("kv@10.1.2.3:8000@Qwen/Qwen3-32B"),
            Some(TopicIdentity {
                address: "10.1.2.3:8000".into(),
                model: "Qwen/Qwen3-32B".into()
            })
        );
        assert_eq!(
            parse_topic("kv@[::1]:8000@m@x"),
            Some(TopicIdentity {
                address: "[::1]:8000".into(),
                model: "m@x".into()
            })
        );
        assert_eq!(
            parse_topic("kv@pod-a:80").map(|t| t.model),
            Some(String::new())
        );
        assert_eq!(parse_topic(""), None);
        assert_eq!(parse_topic("kv@dp0"), None);
        assert_eq!(parse_topic("kv@host:99999@m"), None);
        assert_eq!(parse_topic("kv@:80@m"), None);
        assert_eq!(parse_topic("xx@1.2.3.4:80@m"), None);
    }

    #[test]
    fn garbage_is_an_error() {
        assert_eq!(decode_batch(&[]), Err(EventError::Truncated));
        assert_eq!(
            decode_batch(&[0x91, 0xc1]).err(),
            Some(EventError::MissingField {
                event: "batch",
                field: "events"
            })
        );
        assert_eq!(
            decode_batch(&[0x92, 0xc1, 0x90]).err(),
            Some(EventError::UnexpectedType {
                what: "ts",
                found: "invalid"
            })
        );
        assert_eq!(
            decode_batch(&[0x92, 0xcb, 0x00]).err(),
            Some(EventError::Truncated)
        );
        // Huge array counts are refused before allocating.
        assert!(matches!(
            decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
            Err(EventError::CountTooLarge { .. })
        ));
        // Deep nesting in an unknown field.
        let mut deep = vec![0x92, 0x00, 0x91, 0x82, 0xa4, b't', b'y', b'p', b'e'];
        deep.extend_from_slice(&[0xb0]);
        deep.extend_from_slice(b"AllBlocksCleared");
        deep.extend_from_slice(&[0xa1, b'x']);
        deep.extend(std::iter::repeat_n(0x91, 100));
        deep.push(0x00);
        assert_eq!(decode_batch(&deep), Err(EventError::TooDeep));
    }

    /// Minimal msgpack writer for hand-built (array-encoded, vLLM ≤ 0.20) cases.
    #[derive(Default)]
    struct W(Vec<u8>);

    impl W {
        fn arr(&mut self, n: usize) -> &mut Self {
            if n < 16 {
                self.0.push(0x90 | n as u8);
            } else {
                self.0.push(0xdc);
                self.0.extend_from_slice(&(n as u16).to_be_bytes());
            }
            self
        }
        fn map(&mut self, n: usize) -> &mut Self {
            self.0.push(0x80 | n as u8);
            self
        }
        fn s(&mut self, v: &str) -> &mut Self {
            assert!(v.len() < 32);
            self.0.push(0xa0 | v.len() as u8);
            self.0.extend_from_slice(v.as_bytes());
            self
        }
        fn u(&mut self, v: u64) -> &mut Self {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn i(&mut self, v: i64) -> &mut Self {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn small(&mut self, v: u8) -> &mut Self {
            assert!(v < 128);
            self.0.push(v);
            self
        }
        fn nil(&mut self) -> &mut Self {
            self.0.push(0xc0);
            self
        }
        fn f64(&mut self, v: f64) -> &mut Self {
            self.0.push(0xcb);
            self.0.extend_from_slice(&v.to_bits().to_be_bytes());
            self
        }
        fn bin(&mut self, v: &[u8]) -> &mut Self {
            self.0.push(0xc4);
            self.0.push(v.len() as u8);
            self.0.extend_from_slice(v);
            self
        }
        fn tokens(&mut self, t: &[u32]) -> &mut Self {
            self.arr(t.len());
            for &x in t {
                self.0.push(0xce);
                self.0.extend_from_slice(&x.to_be_bytes());
            }
            self
        }
    }

    fn tokens(n: u32) -> Vec<u32> {
        (0..n).map(|i| 100_000 + i).collect()
    }

    #[test]
    fn array_encoding_full_form() {
        // [ts, [stored, removed, cleared], rank] with every positional field.
        let mut w = W::default();
        w.arr(3).f64(1.5).arr(3);
        w.arr(12).s("BlockStored").arr(2).u(u64::MAX).u(7).u(9);
        w.tokens(&tokens(32))
            .small(16)
            .small(3)
            .s("CPU")
            .s("my-lora");
        w.arr(1).s("salt").small(1).s("full").nil();
        w.arr(4).s("BlockRemoved").arr(1).i(-2).s("GPU").small(0);
        w.arr(1).s("AllBlocksCleared");
        w.small(2);
        let b = decode_batch(&w.0).expect("decodes");
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.data_parallel_rank, Some(2));
        assert_eq!(
            b.events,
            vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![u64::MAX, 7],
                    parent_block_hash: Some(9),
                    token_ids: tokens(32),
                    block_size: 16,
                    lora_id: Some(3),
                    medium: Some(Medium::Cpu),
                    lora_name: Some("my-lora".into()),
                    group_idx: Some(1),
                }),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![(-2i64) as u64],
                    medium: Some(Medium::Gpu),
                    group_idx: Some(0),
                }),
                KvEvent::AllBlocksCleared,
            ]
        );
    }

    #[test]
    fn array_encoding_oldest_form() {
        // The oldest form: [ts, events] with 6-element BlockStored, i64 hashes,
        // 2-element BlockRemoved, bin hashes accepted too.
        let mut w = W::default();
        w.arr(2).f64(2.0).arr(2);
        w.arr(6)
            .s("BlockStored")
            .arr(1)
            .i(-5)
            .nil()
            .tokens(&tokens(16))
            .small(16)
            .nil();
        w.arr(2).s("BlockRemoved").arr(1).bin(&[0xaa; 32]);
        let b = decode_batch(&w.0).expect("decodes");
        assert_eq!(b.data_parallel_rank, None);
        assert_eq!(
            b.events,
            vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![(-5i64) as u64],
                    token_ids: tokens(16),
                    block_size: 16,
                    ..BlockStored::default()
                }),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![0xaaaa_aaaa_aaaa_aaaa],
                    ..BlockRemoved::default()
                }),
            ]
        );
        // 8-element BlockStored (medium and lora_name present, no extra_keys).
        let mut w = W::default();
        w.arr(2).f64(2.0).arr(1);
        w.arr(8)
            .s("BlockStored")
            .arr(1)
            .u(1)
            .u(2)
            .tokens(&tokens(16))
            .small(16);
        w.nil().nil().nil();
        let b = decode_batch(&w.0).expect("decodes");
        assert!(matches!(&b.events[0], KvEvent::BlockStored(e) if e.parent_block_hash == Some(2)));
    }

    #[test]
    fn unknown_fields_and_types_are_tolerated() {
        let mut w = W::default();
        w.arr(4).f64(0.0).arr(3);
        // Map event with an unknown nested field before the type and one after.
        w.map(4).s("future").map(1).s("k").arr(2).nil().f64(1.0);
        w.s("type")
            .s("BlockRemoved")
            .s("block_hashes")
            .arr(1)
            .small(5);
        w.s("blob").bin(&[1, 2, 3]);
        // Array event with extra trailing elements.
        w.arr(6).s("BlockRemoved").arr(0).nil().nil().s("x").map(0);
        // Unknown event type.
        w.arr(2).s("BlockMoved").small(1);
        w.small(0).s("extra batch element");
        let b = decode_batch(&w.0).expect("decodes");
        assert_eq!(
            b.events,
            vec![
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![5],
                    ..BlockRemoved::default()
                }),
                KvEvent::BlockRemoved(BlockRemoved::default()),
                KvEvent::Unknown {
                    tag: "BlockMoved".into()
                },
            ]
        );
    }

    #[test]
    fn typed_errors_for_bad_fields() {
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(1).map(1).s("block_hashes").arr(0);
        assert_eq!(
            decode_batch(&w.0),
            Err(EventError::MissingField {
                event: "event",
                field: "type"
            })
        );
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(1).map(1).s("type").s("BlockStored");
        assert!(matches!(
            decode_batch(&w.0),
            Err(EventError::MissingField {
                event: "BlockStored",
                ..
            })
        ));
        let mut w = W::default();
        w.arr(2)
            .f64(0.0)
            .arr(1)
            .arr(5)
            .s("BlockStored")
            .arr(0)
            .nil();
        w.arr(1).i(-1).small(16);
        assert_eq!(
            decode_batch(&w.0),
            Err(EventError::OutOfRange { what: "token_ids" })
        );
        let mut w = W::default();
        w.arr(2)
            .f64(0.0)
            .arr(1)
            .arr(5)
            .s("BlockStored")
            .arr(0)
            .nil();
        w.arr(0).small(0);
        assert_eq!(
            decode_batch(&w.0),
            Err(EventError::OutOfRange { what: "block_size" })
        );
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(1).small(3);
        assert_eq!(
            decode_batch(&w.0),
            Err(EventError::UnexpectedType {
                what: "event",
                found: "int"
            })
        );
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(0).small(1);
        assert_eq!(decode_batch(&w.0), Err(EventError::TrailingBytes(1)));
        let mut w = W::default();
        w.arr(2)
            .f64(0.0)
            .arr(1)
            .arr(2)
            .s("BlockRemoved")
            .arr(1)
            .nil();
        assert_eq!(
            decode_batch(&w.0),
            Err(EventError::UnexpectedType {
                what: "block_hashes",
                found: "nil"
            })
        );
    }

    // ------------------------------------------------ golden vLLM captures

    fn golden_dir() -> std::path::PathBuf {
        kvroute_testdata::vllm_golden_frames()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
            .collect()
    }

    fn json_hash(v: &serde_json::Value) -> u64 {
        if let Some(n) = v.as_u64() {
            n
        } else if let Some(n) = v.as_i64() {
            n as u64
        } else {
            fold_hash_bytes(&unhex(v["bin_hex"].as_str().expect("bin_hex")))
        }
    }

    /// Checks a decoded batch against the capture's generic msgpack decode.
    fn check_against_json(b: &EventBatch, j: &serde_json::Value) {
        let arr = j.as_array().expect("batch array");
        assert_eq!(b.ts, arr[0].as_f64().expect("ts"));
        assert_eq!(b.data_parallel_rank, arr.get(2).and_then(|v| v.as_i64()));
        let evs = arr[1].as_array().expect("events");
        assert_eq!(b.events.len(), evs.len());
        for (e, j) in b.events.iter().zip(evs) {
            let hashes = |v: &serde_json::Value| -> Vec<u64> {
                v.as_array()
                    .expect("hashes")
                    .iter()
                    .map(json_hash)
                    .collect()
            };
            let medium = |v: &serde_json::Value| v.as_str().map(Medium::parse);
            match (e, j["type"].as_str().expect("type")) {
                (KvEvent::BlockStored(s), "BlockStored") => {
                    assert_eq!(s.block_hashes, hashes(&j["block_hashes"]));
                    assert_eq!(
                        s.parent_block_hash,
                        (!j["parent_block_hash"].is_null())
                            .then(|| json_hash(&j["parent_block_hash"]))
                    );
                    let toks: Vec<u32> = j["token_ids"]
                        .as_array()
                        .expect("tokens")
                        .iter()
                        .map(|t| t.as_u64().expect("token") as u32)
                        .collect();
                    assert_eq!(s.token_ids, toks);
                    assert_eq!(
                        u64::from(s.block_size),
                        j["block_size"].as_u64().expect("bs")
                    );
                    assert_eq!(s.lora_id, j["lora_id"].as_i64());
                    assert_eq!(s.medium, medium(&j["medium"]));
                    assert_eq!(s.lora_name.as_deref(), j["lora_name"].as_str());
                    assert_eq!(s.group_idx, j["group_idx"].as_i64());
                }
                (KvEvent::BlockRemoved(r), "BlockRemoved") => {
                    assert_eq!(r.block_hashes, hashes(&j["block_hashes"]));
                    assert_eq!(r.medium, medium(&j["medium"]));
                    assert_eq!(r.group_idx, j["group_idx"].as_i64());
                }
                (KvEvent::AllBlocksCleared, "AllBlocksCleared") => {}
                (e, t) => panic!("decoded {e:?} for a {t} event"),
            }
        }
    }

    fn split_multipart(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = u32::from_be_bytes(rest[..4].try_into().expect("len")) as usize;
            frames.push(rest[4..4 + n].to_vec());
            rest = &rest[4 + n..];
        }
        frames
    }

    fn golden_payloads() -> Vec<(String, Vec<u8>)> {
        let dir = golden_dir();
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("golden captures at {}: {e}", dir.display()))
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".payload.msgpack"))
            .collect();
        names.sort();
        names
            .into_iter()
            .map(|n| {
                let bytes = std::fs::read(dir.join(&n)).expect("read");
                (n, bytes)
            })
            .collect()
    }

    #[test]
    fn golden_frames_decode_and_match_their_json() {
        let dir = golden_dir();
        let payloads = golden_payloads();
        assert!(
            payloads.len() >= 18,
            "expected every golden capture, found {}",
            payloads.len()
        );
        for (name, payload) in &payloads {
            let stem = name.trim_end_matches(".payload.msgpack");
            let multipart = std::fs::read(dir.join(format!("{stem}.multipart.bin"))).expect("mp");
            let frames = split_multipart(&multipart);
            assert_eq!(frames.len(), 3, "{stem}");
            assert_eq!(&frames[2], payload, "{stem}");
            let txt: serde_json::Value = serde_json::from_slice(
                &std::fs::read(dir.join(format!("{stem}.txt"))).expect("txt"),
            )
            .expect("json");
            let seq = decode_seq(&frames[1]).expect("seq");
            assert_eq!(
                frames[1],
                unhex(txt["frames"]["seq_hex"].as_str().expect("seq_hex")),
                "{stem}"
            );
            if let Some(s) = txt["frames"]["seq"].as_u64() {
                assert_eq!(seq, s, "{stem}");
            }
            let batch = decode_batch(payload).unwrap_or_else(|e| panic!("{stem}: {e}"));
            check_against_json(&batch, &txt["msgpack_decoded"]);
        }
    }

    #[test]
    fn golden_int_and_bytes_captures_fold_to_the_same_events() {
        let payloads = golden_payloads();
        let mut pairs = 0;
        for (name, payload) in &payloads {
            if let Some(rest) = name.strip_prefix("int_") {
                let other = payloads
                    .iter()
                    .find(|(n, _)| n.strip_prefix("bytes_") == Some(rest))
                    .expect("bytes twin");
                assert_eq!(
                    decode_batch(payload).expect("int"),
                    decode_batch(&other.1).expect("bytes"),
                    "{rest}"
                );
                pairs += 1;
            }
        }
        assert!(pairs >= 9);
    }

    #[test]
    fn golden_replay_exchanges_decode() {
        for kind in ["int", "bytes"] {
            let path = golden_dir().join(format!("{kind}_replay_from_seq4.txt"));
            let j: serde_json::Value =
                serde_json::from_slice(&std::fs::read(path).expect("replay")).expect("json");
            let msgs = j["reply_messages_frames_hex"].as_array().expect("msgs");
            let mut seqs = Vec::new();
            for m in msgs {
                let frames: Vec<Vec<u8>> = m
                    .as_array()
                    .expect("frames")
                    .iter()
                    .map(|f| unhex(f.as_str().expect("hex")))
                    .collect();
                // >= 0.26: ["", topic, seq, payload]
                assert_eq!(frames.len(), 4);
                let seq = decode_seq(&frames[2]).expect("seq");
                seqs.push(seq);
                if seq == u64::MAX {
                    assert!(frames[3].is_empty());
                } else {
                    decode_batch(&frames[3]).unwrap_or_else(|e| panic!("{kind} seq {seq}: {e}"));
                }
            }
            assert_eq!(seqs, vec![4, 5, 6, u64::MAX]);
        }
    }

    /// Deterministic mutation run over every golden payload and the
    /// hand-built array cases: decode must return (never panic), and any
    /// accepted mutant must decode the same way twice.
    #[test]
    fn mutations_never_panic() {
        let mut seeds: Vec<Vec<u8>> = golden_payloads().into_iter().map(|(_, p)| p).collect();
        let mut w = W::default();
        w.arr(3).f64(1.5).arr(2);
        w.arr(12)
            .s("BlockStored")
            .arr(2)
            .u(1)
            .i(-7)
            .u(9)
            .tokens(&tokens(32))
            .small(16);
        w.small(3)
            .s("CPU")
            .s("l")
            .arr(1)
            .s("salt")
            .small(1)
            .s("full")
            .nil();
        w.arr(4)
            .s("BlockRemoved")
            .arr(1)
            .bin(&[3; 32])
            .s("GPU")
            .small(0);
        w.small(2);
        seeds.push(w.0);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let (mut ok, mut err) = (0, 0);
        for i in 0..30_000 {
            let mut b = seeds[i % seeds.len()].clone();
            for _ in 0..1 + next() % 3 {
                let len = b.len().max(1);
                let at = (next() as usize) % len;
                match next() % 5 {
                    0 => {
                        if let Some(x) = b.get_mut(at) {
                            *x ^= 1 << (next() % 8);
                        }
                    }
                    1 => b.truncate(at),
                    2 => b.insert(at.min(b.len()), next() as u8),
                    3 => {
                        if let Some(x) = b.get_mut(at) {
                            // Markers that change lengths and types.
                            *x = [0xc1, 0xdd, 0xdf, 0xdb, 0xc6, 0xc9, 0xd3, 0x9f]
                                [(next() % 8) as usize];
                        }
                    }
                    _ => {
                        let end = (at + 1 + (next() as usize) % 16).min(b.len());
                        b.drain(at..end);
                    }
                }
            }
            match decode_batch(&b) {
                Ok(x) => {
                    ok += 1;
                    // Debug text: a NaN timestamp decodes fine and NaN != NaN.
                    assert_eq!(
                        format!("{:?}", decode_batch(&b)),
                        format!("{:?}", Ok::<_, EventError>(x))
                    );
                }
                Err(e) => {
                    err += 1;
                    assert!(!e.to_string().is_empty());
                }
            }
        }
        assert!(ok > 0 && err > 0, "ok {ok} err {err}");
    }
}
