//! The payload decoder: batches of map- or array-encoded events, read field by
//! field with rmp where it matters for speed, through rmp-serde elsewhere.

use std::fmt;
use std::io::Cursor;

use kvroute_core::hash::ExtraKey;
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, SeqAccess, Visitor};

use super::{
    fold_hash_bytes, BlockRemoved, BlockStored, DecodedBatch, EventBatch, EventError, KvEvent,
    Medium,
};

/// Deepest nesting followed inside one event (extra keys are nested tuples).
const MAX_DEPTH: usize = 32;

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

/// An array-encoded event (map-encoded ones: `decode_map_event`).
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
