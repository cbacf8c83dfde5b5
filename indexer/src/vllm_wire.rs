//! vLLM KV-cache events on the wire: the msgpack payload decoder (rmp-serde;
//! rmp for the keys, names and token ids of map-encoded events), the sequence
//! and topic frames, and an rmp encoder of the same shapes for tests and
//! benchmarks.
//!
//! Both event encodings vLLM has used are accepted: maps (vLLM ≥ 0.26,
//! `{"type": "BlockStored", ...}`, fields in any order) and positional arrays
//! (vLLM ≤ 0.20, `["BlockStored", hashes, parent, ...]`, trailing fields
//! optional), inside a batch `[ts, events]` or `[ts, events, data_parallel_rank]`.
//! Unknown fields are skipped; unknown event types decode to
//! [`KvEvent::Unknown`]. Block hashes may be unsigned ints (u64), signed ints
//! (older builds, read as the same 64 bits) or byte strings
//! (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`), folded by [`fold_hash_bytes`].
//!
//! Events are decoded one by one: an event that is well-formed msgpack but not
//! a valid event (a wrong field type, a missing field) is skipped and reported
//! in [`DecodedBatch::skipped`], and the rest of its batch is kept. Only a
//! payload that is not a msgpack batch at all is refused as a whole.

use std::fmt;
use std::io::Cursor;

use kvroute_core::feed::Tier;
use kvroute_core::hash::ExtraKey;
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, SeqAccess, Visitor};

/// Deepest nesting followed inside one event (extra keys are nested tuples).
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

/// A decoded payload: the usable events, and why the others were skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    pub batch: EventBatch,
    pub skipped: Vec<EventError>,
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
    /// Tokens of all stored blocks, concatenated (empty in CPU-offload placeholders).
    pub token_ids: Vec<u32>,
    /// Tokens per block (0 in CPU-offload placeholders).
    pub block_size: u32,
    /// LoRA adapter id, when the request used one.
    pub lora_id: Option<i64>,
    /// Storage medium (`None`: GPU).
    pub medium: Option<Medium>,
    /// LoRA adapter name (vLLM ≥ 0.26).
    pub lora_name: Option<String>,
    /// Per block: the extra keys vLLM hashed it with (LoRA name, multimodal
    /// identifiers, cache salt on block 0), `None` when it had none.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// KV-cache group (hybrid models).
    pub group_idx: Option<i64>,
    /// Kind of the group's KV-cache spec (`full_attention`, `sliding_window`, `mamba`…).
    pub kv_cache_spec_kind: Option<String>,
}

impl BlockStored {
    /// vLLM's offloading connectors announce blocks copied to CPU memory with
    /// an event that carries no tokens and block size 0: only their hashes.
    pub fn is_placeholder(&self) -> bool {
        self.block_size == 0 && self.token_ids.is_empty()
    }
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

    fn name(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Other(name) => name,
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

/// Why a payload, or one event of it, could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventError {
    /// The input ended inside a value.
    Truncated,
    /// Bytes that are not msgpack, or a value of the wrong msgpack type.
    Malformed(String),
    /// Nesting deeper than the decoder follows.
    TooDeep,
    /// An integer outside the range of its field.
    OutOfRange,
    /// Well-formed msgpack that is not a valid batch or event (missing
    /// field, wrong type of a field…).
    Invalid(String),
    /// Bytes left after the batch.
    TrailingBytes(usize),
    /// A sequence frame that is not 8 bytes.
    BadSeqFrame(usize),
}

impl fmt::Display for EventError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventError::Truncated => write!(f, "truncated msgpack"),
            EventError::Malformed(why) => write!(f, "malformed msgpack: {why}"),
            EventError::TooDeep => write!(f, "nesting too deep"),
            EventError::OutOfRange => write!(f, "integer out of range"),
            EventError::Invalid(why) => write!(f, "invalid event: {why}"),
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
            EventError::Malformed(_) => "malformed",
            EventError::TooDeep => "too_deep",
            EventError::OutOfRange => "out_of_range",
            EventError::Invalid(_) => "invalid",
            EventError::TrailingBytes(_) => "trailing_bytes",
            EventError::BadSeqFrame(_) => "bad_seq_frame",
        }
    }
}

impl From<rmp_serde::decode::Error> for EventError {
    fn from(e: rmp_serde::decode::Error) -> Self {
        use rmp_serde::decode::Error as E;
        match e {
            E::InvalidMarkerRead(io) | E::InvalidDataRead(io)
                if io.kind() == std::io::ErrorKind::UnexpectedEof =>
            {
                EventError::Truncated
            }
            E::DepthLimitExceeded => EventError::TooDeep,
            E::OutOfRange => EventError::OutOfRange,
            E::Syntax(why) | E::Uncategorized(why) => EventError::Invalid(why),
            // 0xc1 starts no msgpack value; any other marker is valid msgpack
            // of a type the field does not take.
            E::TypeMismatch(marker) if marker != rmp::Marker::Reserved => {
                EventError::Invalid(format!("unexpected {marker:?}"))
            }
            other => EventError::Malformed(other.to_string()),
        }
    }
}

impl From<rmp::decode::ValueReadError> for EventError {
    fn from(e: rmp::decode::ValueReadError) -> Self {
        rmp_serde::decode::Error::from(e).into()
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

/// Pod identity carried in a topic `kv@<ip:port>@<model>`, borrowed from
/// the topic (read on every message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicIdentity<'a> {
    /// `ip:port` of the pod's HTTP server.
    pub address: &'a str,
    /// Served model name (may be empty).
    pub model: &'a str,
}

/// Parses the topic convention `kv@<ip:port>@<model>`; `None` for any
/// other topic (e.g. vLLM's default empty topic or `kv@dp0`). The address
/// must look like `host:port` (port digits; `[v6]:port` accepted); the model
/// is everything after the second `@` (model names may contain `@`).
pub fn parse_topic(topic: &str) -> Option<TopicIdentity<'_>> {
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
    Some(TopicIdentity { address, model })
}

// ------------------------------------------------------------------ decoder

/// Decodes a payload `[ts, events, data_parallel_rank?, ...]`.
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, EventError> {
    let mut d = deserializer(Cursor::new(payload));
    let fields = rmp::decode::read_array_len(d.get_mut())?;
    if fields < 2 {
        return Err(EventError::Invalid("batch: missing events".into()));
    }
    let ts = f64::deserialize(&mut d)?;
    let count = rmp::decode::read_array_len(d.get_mut())?;
    let mut cursor = d.into_inner();
    // Every event takes at least one byte: a count beyond the input is a lie.
    if u64::from(count) > left(&cursor) {
        return Err(EventError::Truncated);
    }
    let mut events = Vec::with_capacity(count as usize);
    let mut skipped = Vec::new();
    for _ in 0..count {
        let start = cursor.position();
        let event = match cursor.get_ref().get(start as usize) {
            Some(&marker) if is_map(marker) => decode_map_event(&mut cursor),
            _ => value::<KvEvent>(&mut cursor),
        };
        match event {
            Ok(e) => events.push(e),
            Err(e) => {
                // Not an event: step over it as a msgpack value, or give up
                // on the batch when it is not even that.
                cursor.set_position(start);
                value::<IgnoredAny>(&mut cursor)?;
                skipped.push(e);
            }
        }
    }
    let mut d = deserializer(cursor);
    let mut data_parallel_rank = None;
    if fields >= 3 {
        data_parallel_rank = Option::<i64>::deserialize(&mut d)?;
    }
    for _ in 3..fields {
        IgnoredAny::deserialize(&mut d)?;
    }
    match remaining(&d) {
        0 => Ok(DecodedBatch {
            batch: EventBatch {
                ts,
                events,
                data_parallel_rank,
            },
            skipped,
        }),
        n => Err(EventError::TrailingBytes(
            usize::try_from(n).unwrap_or(usize::MAX),
        )),
    }
}

type PayloadDeserializer<'a> =
    rmp_serde::Deserializer<rmp_serde::decode::ReadReader<Cursor<&'a [u8]>>>;

fn deserializer(cursor: Cursor<&[u8]>) -> PayloadDeserializer<'_> {
    let mut d = rmp_serde::Deserializer::new(cursor);
    d.set_max_depth(MAX_DEPTH);
    d
}

/// Bytes of the payload not read yet.
fn remaining(d: &PayloadDeserializer<'_>) -> u64 {
    left(d.get_ref())
}

fn left(cursor: &Cursor<&[u8]>) -> u64 {
    (cursor.get_ref().len() as u64).saturating_sub(cursor.position())
}

/// One msgpack value at the cursor, through serde.
fn value<T: de::DeserializeOwned>(cursor: &mut Cursor<&[u8]>) -> Result<T, EventError> {
    let mut d = rmp_serde::Deserializer::new(cursor);
    d.set_max_depth(MAX_DEPTH);
    Ok(T::deserialize(&mut d)?)
}

/// A fixmap, map16 or map32 marker.
fn is_map(marker: u8) -> bool {
    matches!(marker, 0x80..=0x8f | 0xde | 0xdf)
}

/// Token ids. Through serde each took ~9 ns, half of the indexer's whole
/// apply cost per block (16 tokens a block), mostly mispredicted branches on
/// the int width (ids below and above 65,536 alternate at random); so the
/// unsigned forms are read without a branch on it, and anything else (the
/// last 8 bytes of the payload, a negative or not-int token) by rmp.
fn read_tokens(cursor: &mut Cursor<&[u8]>) -> Result<Vec<u32>, EventError> {
    let n = rmp::decode::read_array_len(cursor)?;
    // Every token takes at least one byte: a count beyond the input is a lie.
    if u64::from(n) > left(cursor) {
        return Err(EventError::Truncated);
    }
    let mut tokens = Vec::with_capacity(n as usize);
    let payload: &[u8] = cursor.get_ref();
    let mut at = usize::try_from(cursor.position()).unwrap_or(usize::MAX);
    for _ in 0..n {
        match unsigned_at(payload, at) {
            Some((token, len)) => {
                tokens.push(token);
                at += len;
            }
            None => {
                cursor.set_position(at as u64);
                let token =
                    rmp::decode::read_int(cursor).map_err(rmp_serde::decode::Error::from)?;
                tokens.push(token);
                at = usize::try_from(cursor.position()).unwrap_or(usize::MAX);
            }
        }
    }
    cursor.set_position(at as u64);
    Ok(tokens)
}

/// Bytes of the msgpack unsigned int (fixint, uint 8/16/32) starting with
/// each marker byte; 0: another type, or a uint 64.
const UINT_LEN: [u8; 256] = {
    let mut len = [0u8; 256];
    let mut m = 0;
    while m < 0x80 {
        len[m] = 1;
        m += 1;
    }
    len[0xcc] = 2;
    len[0xcd] = 3;
    len[0xce] = 5;
    len
};

/// The u32 at `at` and its length in bytes, when it is an unsigned int with
/// 8 bytes after its marker to read at once.
fn unsigned_at(payload: &[u8], at: usize) -> Option<(u32, usize)> {
    let marker = *payload.get(at)?;
    let next: [u8; 8] = payload.get(at + 1..at + 9)?.try_into().ok()?;
    let len = usize::from(UINT_LEN[usize::from(marker)]);
    // The big-endian value after the marker is the top len - 1 bytes.
    let after = u64::from_be_bytes(next) >> (8 * (9 - len.max(2)));
    let value = if len == 1 { u64::from(marker) } else { after };
    (len > 0).then_some((value as u32, len))
}

/// A msgpack string at the cursor, borrowed from the payload (rmp-serde
/// copies each one through `Read::read_to_end`; a key only needs comparing).
fn read_str<'a>(cursor: &mut Cursor<&'a [u8]>) -> Result<&'a str, EventError> {
    std::str::from_utf8(read_str_bytes(cursor)?).map_err(|e| EventError::Invalid(e.to_string()))
}

/// The bytes of a msgpack string at the cursor, not checked as UTF-8: for
/// comparing with known names (a key or tag that is not valid UTF-8 matches
/// none of them).
fn read_str_bytes<'a>(cursor: &mut Cursor<&'a [u8]>) -> Result<&'a [u8], EventError> {
    let len = rmp::decode::read_str_len(cursor)? as usize;
    let payload: &'a [u8] = cursor.get_ref();
    let start = usize::try_from(cursor.position()).unwrap_or(usize::MAX);
    let bytes = start
        .checked_add(len)
        .and_then(|end| payload.get(start..end))
        .ok_or(EventError::Truncated)?;
    cursor.set_position(cursor.position() + len as u64);
    Ok(bytes)
}

/// A string or nil, borrowed from the payload.
fn read_opt_str<'a>(cursor: &mut Cursor<&'a [u8]>) -> Result<Option<&'a str>, EventError> {
    let at = cursor.position();
    if cursor.get_ref().get(at as usize) == Some(&NIL) {
        cursor.set_position(at + 1);
        return Ok(None);
    }
    Ok(Some(read_str(cursor)?))
}

const NIL: u8 = 0xc0;

/// A map-encoded event (vLLM ≥ 0.26: `{"type": tag, field: value…}`;
/// unknown fields skipped), field by field with rmp: keys, names and token
/// ids directly, the other values through serde.
fn decode_map_event(cursor: &mut Cursor<&[u8]>) -> Result<KvEvent, EventError> {
    let fields = rmp::decode::read_map_len(cursor)?;
    let mut tag: Option<Tag> = None;
    let mut block_hashes: Option<Vec<u64>> = None;
    let mut parent: Option<Option<WireHash>> = None;
    let mut token_ids: Option<Vec<u32>> = None;
    let mut block_size: Option<u32> = None;
    let mut stored = BlockStored::default();
    let mut medium_name: Option<&str> = None;
    for _ in 0..fields {
        match Field::of(read_str_bytes(cursor)?) {
            Field::Type => tag = Some(Tag::read(cursor)?),
            Field::BlockHashes => block_hashes = Some(read_hashes(cursor)?),
            Field::ParentBlockHash => parent = Some(value(cursor)?),
            Field::TokenIds => token_ids = Some(read_tokens(cursor)?),
            Field::BlockSize => block_size = Some(value(cursor)?),
            Field::LoraId => stored.lora_id = value(cursor)?,
            Field::Medium => medium_name = read_opt_str(cursor)?,
            Field::LoraName => stored.lora_name = read_opt_str(cursor)?.map(str::to_owned),
            Field::ExtraKeys => stored.extra_keys = extra_keys(value(cursor)?),
            Field::GroupIdx => stored.group_idx = value(cursor)?,
            Field::KvCacheSpecKind => {
                stored.kv_cache_spec_kind = read_opt_str(cursor)?.map(str::to_owned)
            }
            Field::Other => {
                value::<IgnoredAny>(cursor)?;
            }
        }
    }
    fn present<T>(value: Option<T>, field: &'static str) -> Result<T, EventError> {
        value.ok_or_else(|| EventError::Invalid(format!("missing field `{field}`")))
    }
    Ok(match present(tag, "type")? {
        Tag::BlockStored => KvEvent::BlockStored(BlockStored {
            block_hashes: present(block_hashes, "block_hashes")?,
            parent_block_hash: present(parent, "parent_block_hash")?.map(|h| h.0),
            token_ids: present(token_ids, "token_ids")?,
            block_size: present(block_size, "block_size")?,
            medium: medium_name.map(Medium::parse),
            ..stored
        }),
        Tag::BlockRemoved => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: present(block_hashes, "block_hashes")?,
            medium: medium_name.map(Medium::parse),
            group_idx: stored.group_idx,
        }),
        Tag::AllBlocksCleared => KvEvent::AllBlocksCleared,
        Tag::Other(tag) => KvEvent::Unknown { tag },
    })
}

/// A map-encoded event's `type`, owned only when it is none kvroute knows.
enum Tag {
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
    Other(String),
}

impl Tag {
    fn read(cursor: &mut Cursor<&[u8]>) -> Result<Tag, EventError> {
        Ok(match read_str_bytes(cursor)? {
            b"BlockStored" => Tag::BlockStored,
            b"BlockRemoved" => Tag::BlockRemoved,
            b"AllBlocksCleared" => Tag::AllBlocksCleared,
            other => Tag::Other(String::from_utf8_lossy(other).into_owned()),
        })
    }
}

/// Block hashes (an array of them in any of their wire forms). vLLM's
/// int form is a uint 64, read here directly; any other form through serde.
fn read_hashes(cursor: &mut Cursor<&[u8]>) -> Result<Vec<u64>, EventError> {
    let at = cursor.position();
    if !matches!(
        cursor.get_ref().get(at as usize),
        Some(0x90..=0x9f | 0xdc | 0xdd)
    ) {
        // Not an array: serde says what it is (a bin must not pass for one).
        return Ok(value::<WireHashes>(cursor)?.0);
    }
    let n = rmp::decode::read_array_len(cursor)?;
    // Every hash takes at least one byte: a count beyond the input is a lie.
    if u64::from(n) > left(cursor) {
        return Err(EventError::Truncated);
    }
    let mut hashes = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let payload: &[u8] = cursor.get_ref();
        let at = usize::try_from(cursor.position()).unwrap_or(usize::MAX);
        let uint64 = match payload.get(at..at.saturating_add(9)) {
            Some([UINT64, rest @ ..]) => <[u8; 8]>::try_from(rest).ok(),
            _ => None,
        };
        match uint64 {
            Some(be) => {
                hashes.push(u64::from_be_bytes(be));
                cursor.set_position(at as u64 + 9);
            }
            None => hashes.push(value::<WireHash>(cursor)?.0),
        }
    }
    Ok(hashes)
}

/// The msgpack marker of a uint 64.
const UINT64: u8 = 0xcf;

/// A block hash in any of its wire forms.
struct WireHash(u64);

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = WireHash;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (int or bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireHash, E> {
                Ok(WireHash(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireHash, E> {
                Ok(WireHash(v as u64))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<WireHash, E> {
                Ok(WireHash(fold_hash_bytes(v)))
            }
        }
        d.deserialize_any(V)
    }
}

struct WireHashes(Vec<u64>);

impl<'de> Deserialize<'de> for WireHashes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireHashes;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of block hashes")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<WireHashes, A::Error> {
                // The hint is the wire's count: capped, the input may lie.
                let mut hashes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(WireHash(h)) = seq.next_element()? {
                    hashes.push(h);
                }
                Ok(WireHashes(hashes))
            }
        }
        // `any`, not `seq`: a bin would otherwise pass for an array of its bytes.
        d.deserialize_any(V)
    }
}

/// The fields of a map-encoded event kvroute reads; others are skipped.
enum Field {
    Type,
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    Other,
}

impl Field {
    fn of(key: &[u8]) -> Field {
        match key {
            b"type" => Field::Type,
            b"block_hashes" => Field::BlockHashes,
            b"parent_block_hash" => Field::ParentBlockHash,
            b"token_ids" => Field::TokenIds,
            b"block_size" => Field::BlockSize,
            b"lora_id" => Field::LoraId,
            b"medium" => Field::Medium,
            b"lora_name" => Field::LoraName,
            b"extra_keys" => Field::ExtraKeys,
            b"group_idx" => Field::GroupIdx,
            b"kv_cache_spec_kind" => Field::KvCacheSpecKind,
            _ => Field::Other,
        }
    }
}

/// Any msgpack value of an extra key.
struct WireKey(ExtraKey);

impl<'de> Deserialize<'de> for WireKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an extra key")
            }
            fn visit_unit<E: de::Error>(self) -> Result<WireKey, E> {
                Ok(WireKey(ExtraKey::Nil))
            }
            fn visit_none<E: de::Error>(self) -> Result<WireKey, E> {
                Ok(WireKey(ExtraKey::Nil))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<WireKey, E> {
                Ok(WireKey(ExtraKey::Bool(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireKey, E> {
                Ok(WireKey(ExtraKey::Int(i128::from(v))))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireKey, E> {
                Ok(WireKey(ExtraKey::Int(i128::from(v))))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<WireKey, E> {
                Ok(WireKey(ExtraKey::Float(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<WireKey, E> {
                Ok(WireKey(ExtraKey::Str(v.to_owned())))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<WireKey, E> {
                Ok(WireKey(ExtraKey::Bytes(v.to_vec())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<WireKey, A::Error> {
                let mut items = Vec::new();
                while let Some(WireKey(k)) = seq.next_element()? {
                    items.push(k);
                }
                Ok(WireKey(ExtraKey::List(items)))
            }
        }
        d.deserialize_any(V)
    }
}

type WireExtraKeys = Option<Vec<Option<Vec<WireKey>>>>;

fn extra_keys(wire: WireExtraKeys) -> Option<Vec<Option<Vec<ExtraKey>>>> {
    wire.map(|blocks| {
        blocks
            .into_iter()
            .map(|keys| keys.map(|keys| keys.into_iter().map(|k| k.0).collect()))
            .collect()
    })
}

fn medium(name: Option<String>) -> Option<Medium> {
    name.map(|n| Medium::parse(&n))
}

/// An array-encoded event (map-encoded ones: [`decode_map_event`]).
impl<'de> Deserialize<'de> for KvEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EventVisitor)
    }
}

struct EventVisitor;

/// Reads the next positional field, `None` when the array ended (trailing
/// fields vLLM leaves out have their default).
fn next<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(seq: &mut A) -> Result<Option<T>, A::Error> {
    seq.next_element()
}

fn required<T, E: de::Error>(value: Option<T>, field: &'static str) -> Result<T, E> {
    value.ok_or_else(|| E::missing_field(field))
}

impl<'de> Visitor<'de> for EventVisitor {
    type Value = KvEvent;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a KV event array")
    }

    /// vLLM ≤ 0.20: `[tag, fields…]` in declaration order.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KvEvent, A::Error> {
        let tag: String = required(next(&mut seq)?, "type")?;
        let event = match tag.as_str() {
            "BlockStored" => {
                let block_hashes = required(next::<_, WireHashes>(&mut seq)?, "block_hashes")?.0;
                let parent: Option<WireHash> =
                    required(next::<_, Option<WireHash>>(&mut seq)?, "parent_block_hash")?;
                let token_ids = required(next(&mut seq)?, "token_ids")?;
                let block_size = required(next(&mut seq)?, "block_size")?;
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash: parent.map(|h| h.0),
                    token_ids,
                    block_size,
                    lora_id: next(&mut seq)?.flatten(),
                    medium: medium(next(&mut seq)?.flatten()),
                    lora_name: next(&mut seq)?.flatten(),
                    extra_keys: extra_keys(next(&mut seq)?.flatten()),
                    group_idx: next(&mut seq)?.flatten(),
                    kv_cache_spec_kind: next(&mut seq)?.flatten(),
                })
            }
            "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: required(next::<_, WireHashes>(&mut seq)?, "block_hashes")?.0,
                medium: medium(next(&mut seq)?.flatten()),
                group_idx: next(&mut seq)?.flatten(),
            }),
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            _ => KvEvent::Unknown { tag },
        };
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(event)
    }
}

// ------------------------------------------------------------------ encoder

/// Which event encoding to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// vLLM ≥ 0.26: events are maps.
    Map,
    /// vLLM ≤ 0.20: events are positional arrays.
    Array,
}

/// How block hashes are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashForm {
    /// uint64 (vLLM default).
    Uint,
    /// 32-byte bin whose last 8 bytes are the hash (big-endian).
    Bin32,
}

/// Writes msgpack into a Vec, which cannot fail.
struct Writer<'a> {
    out: &'a mut Vec<u8>,
    form: HashForm,
}

// `rmp::encode` reports write errors of its `Write`; a Vec never fails, so
// the results are ignored.
impl Writer<'_> {
    fn array(&mut self, n: usize) {
        let _ = rmp::encode::write_array_len(self.out, n as u32);
    }
    fn map(&mut self, n: usize) {
        let _ = rmp::encode::write_map_len(self.out, n as u32);
    }
    fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(self.out, s);
    }
    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(self.out);
    }
    fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(self.out, v);
    }
    fn int(&mut self, v: i64) {
        let _ = rmp::encode::write_sint(self.out, v);
    }
    fn hash(&mut self, h: u64) {
        match self.form {
            HashForm::Uint => {
                let _ = rmp::encode::write_u64(self.out, h);
            }
            HashForm::Bin32 => {
                let mut digest = [0x5a; 32];
                digest[24..].copy_from_slice(&h.to_be_bytes());
                let _ = rmp::encode::write_bin(self.out, &digest);
            }
        }
    }
    fn hashes(&mut self, hs: &[u64]) {
        self.array(hs.len());
        for &h in hs {
            self.hash(h);
        }
    }
    fn opt_hash(&mut self, h: Option<u64>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }
    fn opt_int(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.int(v),
            None => self.nil(),
        }
    }
    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => self.str(v),
            None => self.nil(),
        }
    }
    fn medium(&mut self, m: Option<&Medium>) {
        self.opt_str(m.map(Medium::name));
    }
    fn tokens(&mut self, t: &[u32]) {
        self.array(t.len());
        for &x in t {
            self.uint(u64::from(x));
        }
    }
    fn key(&mut self, k: &ExtraKey) {
        match k {
            ExtraKey::Nil => self.nil(),
            ExtraKey::Bool(b) => {
                let _ = rmp::encode::write_bool(self.out, *b);
            }
            ExtraKey::Int(v) => match (u64::try_from(*v), i64::try_from(*v)) {
                (Ok(u), _) => self.uint(u),
                (_, Ok(i)) => self.int(i),
                _ => self.nil(),
            },
            ExtraKey::Float(v) => {
                let _ = rmp::encode::write_f64(self.out, *v);
            }
            ExtraKey::Str(s) => self.str(s),
            ExtraKey::Bytes(b) => {
                let _ = rmp::encode::write_bin(self.out, b);
            }
            ExtraKey::List(items) => {
                self.array(items.len());
                for item in items {
                    self.key(item);
                }
            }
        }
    }
    fn extra_keys(&mut self, keys: Option<&Vec<Option<Vec<ExtraKey>>>>) {
        let Some(blocks) = keys else {
            return self.nil();
        };
        self.array(blocks.len());
        for block in blocks {
            match block {
                Some(keys) => {
                    self.array(keys.len());
                    for k in keys {
                        self.key(k);
                    }
                }
                None => self.nil(),
            }
        }
    }
}

/// Encodes a batch as vLLM's publisher would (every field written, `nil` when unset).
pub fn encode_batch(batch: &EventBatch, enc: Encoding, form: HashForm) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    let mut w = Writer {
        out: &mut out,
        form,
    };
    w.array(if batch.data_parallel_rank.is_some() {
        3
    } else {
        2
    });
    let _ = rmp::encode::write_f64(w.out, batch.ts);
    w.array(batch.events.len());
    for ev in &batch.events {
        match (ev, enc) {
            (KvEvent::BlockStored(e), Encoding::Map) => {
                w.map(11);
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.hashes(&e.block_hashes);
                w.str("parent_block_hash");
                w.opt_hash(e.parent_block_hash);
                w.str("token_ids");
                w.tokens(&e.token_ids);
                w.str("block_size");
                w.uint(u64::from(e.block_size));
                w.str("lora_id");
                w.opt_int(e.lora_id);
                w.str("medium");
                w.medium(e.medium.as_ref());
                w.str("lora_name");
                w.opt_str(e.lora_name.as_deref());
                w.str("extra_keys");
                w.extra_keys(e.extra_keys.as_ref());
                w.str("group_idx");
                w.opt_int(e.group_idx);
                w.str("kv_cache_spec_kind");
                w.opt_str(e.kv_cache_spec_kind.as_deref());
            }
            (KvEvent::BlockStored(e), Encoding::Array) => {
                w.array(11);
                w.str("BlockStored");
                w.hashes(&e.block_hashes);
                w.opt_hash(e.parent_block_hash);
                w.tokens(&e.token_ids);
                w.uint(u64::from(e.block_size));
                w.opt_int(e.lora_id);
                w.medium(e.medium.as_ref());
                w.opt_str(e.lora_name.as_deref());
                w.extra_keys(e.extra_keys.as_ref());
                w.opt_int(e.group_idx);
                w.opt_str(e.kv_cache_spec_kind.as_deref());
            }
            (KvEvent::BlockRemoved(e), Encoding::Map) => {
                w.map(4);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.hashes(&e.block_hashes);
                w.str("medium");
                w.medium(e.medium.as_ref());
                w.str("group_idx");
                w.opt_int(e.group_idx);
            }
            (KvEvent::BlockRemoved(e), Encoding::Array) => {
                w.array(4);
                w.str("BlockRemoved");
                w.hashes(&e.block_hashes);
                w.medium(e.medium.as_ref());
                w.opt_int(e.group_idx);
            }
            (KvEvent::AllBlocksCleared, Encoding::Map) => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
            (KvEvent::AllBlocksCleared, Encoding::Array) => {
                w.array(1);
                w.str("AllBlocksCleared");
            }
            (KvEvent::Unknown { tag }, Encoding::Map) => {
                w.map(1);
                w.str("type");
                w.str(tag);
            }
            (KvEvent::Unknown { tag }, Encoding::Array) => {
                w.array(1);
                w.str(tag);
            }
        }
    }
    if let Some(r) = batch.data_parallel_rank {
        w.int(r);
    }
    out
}

#[cfg(test)]
mod tests;
