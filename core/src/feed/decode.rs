//! Reading feed messages, full updates and learned batches: every count
//! checked against the bytes that remain before anything is allocated.

use super::packed_keys::{packed, packed_len};
use super::{
    BlockOp, FeedError, FeedKind, FeedMessage, FeedUpdate, LearnedBatch, PageToken, PodInfo,
    PodLoad, Tier, FEED_MAGIC, FEED_VERSION, FLAG_LOAD, FLAG_MORE, FLAG_PAGE, FLAG_PODS,
    LEARNED_MAGIC, LEARNED_VERSION, MAX_SPEED, MIN_LEARNED_ENTRY_BYTES, MIN_LOAD_BYTES,
    MIN_POD_BYTES, MIN_RUN_BYTES, OP_BITS, OP_CLEARED, OP_REMOVED,
};
use crate::codec::{CodecError, Reader};
use crate::hash::{BlockHash, IndexKey};

fn header(r: &mut Reader<'_>, magic: [u8; 4], version: u16) -> Result<u16, FeedError> {
    if r.take(4, "magic")? != magic {
        return Err(FeedError::BadMagic);
    }
    let v = r.u16("version")?;
    if v != version {
        return Err(FeedError::UnsupportedVersion(v));
    }
    Ok(r.u16("flags")?)
}

fn varint_u32(r: &mut Reader<'_>, what: &'static str) -> Result<u32, FeedError> {
    u32::try_from(r.varint(what)?).map_err(|_| FeedError::TooLarge { what })
}

fn count(r: &mut Reader<'_>, min_item: usize, what: &'static str) -> Result<usize, FeedError> {
    let n = r.varint(what)?;
    Ok(r.checked_count(n, min_item, what)?)
}

fn string(r: &mut Reader<'_>, what: &'static str) -> Result<String, FeedError> {
    let n = count(r, 1, what)?;
    Ok(r.str(n, what)?)
}

fn keys(r: &mut Reader<'_>) -> Result<Vec<IndexKey>, FeedError> {
    let n = r.varint("keys")?;
    if packed_len(n) > r.remaining() as u64 {
        return Err(CodecError::CountTooLarge {
            what: "keys",
            count: n,
            remaining: r.remaining(),
        }
        .into());
    }
    // Packed keys are below 2^INDEX_KEY_BITS: each is its own index key.
    Ok(packed(r, n as usize)?
        .into_iter()
        .map(IndexKey::new)
        .collect())
}

fn speed(r: &mut Reader<'_>) -> Result<f32, FeedError> {
    let bits = r.u32("speed")?;
    let speed = f32::from_bits(bits);
    if bits == 0 || (speed.is_finite() && speed > 0.0 && speed <= MAX_SPEED) {
        Ok(speed)
    } else {
        Err(FeedError::BadSpeed(bits))
    }
}

fn load(r: &mut Reader<'_>) -> Result<PodLoad, FeedError> {
    Ok(PodLoad {
        waiting: varint_u32(r, "waiting")?,
        running: varint_u32(r, "running")?,
        kv_usage: f32::from_bits(r.u32("kv_usage")?),
    })
}

fn finish(r: &Reader<'_>) -> Result<(), FeedError> {
    if r.is_empty() {
        Ok(())
    } else {
        Err(FeedError::TrailingBytes(r.remaining()))
    }
}

/// Decodes one answer of `GET /v1/feed`; never panics. Op pod indices are
/// checked here when the message has a pod list, by the consumer otherwise.
pub fn decode_message(bytes: &[u8]) -> Result<FeedMessage, FeedError> {
    let mut r = Reader::new(bytes);
    let flags = header(&mut r, FEED_MAGIC, FEED_VERSION)?;
    let known = FLAG_PAGE | FLAG_PODS | FLAG_LOAD | FLAG_MORE;
    if flags & !known != 0 || flags & (FLAG_PODS | FLAG_LOAD) == FLAG_PODS | FLAG_LOAD {
        return Err(FeedError::UnknownFlags(flags));
    }
    let epoch = r.u64("epoch")?;
    let cursor = r.u64("cursor")?;
    let pods_version = r.u64("pods_version")?;
    let load_version = r.u64("load_version")?;
    let kind = feed_kind(&mut r, flags)?;
    let pods = if flags & FLAG_PODS != 0 {
        Some(pod_list(&mut r)?)
    } else {
        None
    };
    let load = if flags & FLAG_LOAD != 0 {
        Some(load_list(&mut r)?)
    } else {
        None
    };
    let ops = block_ops(&mut r, pods.as_ref().map(Vec::len))?;
    finish(&r)?;
    Ok(FeedMessage {
        epoch,
        cursor,
        pods_version,
        load_version,
        kind,
        pods,
        load,
        ops,
    })
}

/// A snapshot page (its number, and the token of the next when `FLAG_MORE`)
/// or a delta.
fn feed_kind(r: &mut Reader<'_>, flags: u16) -> Result<FeedKind, FeedError> {
    let more = flags & FLAG_MORE != 0;
    if flags & FLAG_PAGE == 0 {
        return Ok(FeedKind::Delta { more });
    }
    let number = r.u32("page")?;
    let next = if more {
        let start = r.u64("page token")?;
        let after = match r.u8("page token")? {
            0 => None,
            1 => Some(r.u64("page token")?),
            _ => return Err(FeedError::BadBool { what: "page token" }),
        };
        Some(PageToken { start, after })
    } else {
        None
    };
    Ok(FeedKind::Page { number, next })
}

/// The pod list: address, models, capacity, speed and load of each pod.
fn pod_list(r: &mut Reader<'_>) -> Result<Vec<PodInfo>, FeedError> {
    let n = count(r, MIN_POD_BYTES, "pods")?;
    let mut list = Vec::with_capacity(n);
    for _ in 0..n {
        let address = string(r, "address")?;
        let n_models = count(r, 1, "models")?;
        let mut models = Vec::with_capacity(n_models);
        for _ in 0..n_models {
            models.push(string(r, "model")?);
        }
        let mut pod = PodInfo {
            address,
            models,
            capacity_blocks: varint_u32(r, "capacity_blocks")?,
            speed: speed(r)?,
            ..PodInfo::default()
        };
        pod.set_load(load(r)?);
        list.push(pod);
    }
    Ok(list)
}

/// The pods' load alone, in pod-list order.
fn load_list(r: &mut Reader<'_>) -> Result<Vec<PodLoad>, FeedError> {
    let n = count(r, MIN_LOAD_BYTES, "load")?;
    let mut list = Vec::with_capacity(n);
    for _ in 0..n {
        list.push(load(r)?);
    }
    Ok(list)
}

/// The block operations; each names its pod by index into the message's pod
/// list, which bounds it when the message carries one.
fn block_ops(r: &mut Reader<'_>, pods: Option<usize>) -> Result<Vec<BlockOp>, FeedError> {
    let n_runs = count(r, MIN_RUN_BYTES, "runs")?;
    let mut ops = Vec::with_capacity(n_runs);
    for _ in 0..n_runs {
        let op_pod = r.varint("op")?;
        let code = (op_pod & ((1 << OP_BITS) - 1)) as u8;
        let pod =
            u32::try_from(op_pod >> OP_BITS).map_err(|_| FeedError::TooLarge { what: "op pod" })?;
        if let Some(pods) = pods {
            if pod as usize >= pods {
                return Err(FeedError::PodOutOfRange { pod, pods });
            }
        }
        ops.push(match code {
            OP_REMOVED => BlockOp::Removed {
                pod,
                hashes: keys(r)?,
            },
            OP_CLEARED => BlockOp::Cleared { pod },
            code => match Tier::from_code(code) {
                Some(tier) => BlockOp::Stored {
                    pod,
                    tier,
                    hashes: keys(r)?,
                },
                None => return Err(FeedError::BadOpKind(code)),
            },
        });
    }
    Ok(ops)
}

/// Decodes an update as the VMs of one proxy pass it on (see
/// [`encode`](super::encode)); never panics. Without a pod list it is
/// `pods_unchanged`, with the load alone when only that changed.
pub fn decode(bytes: &[u8]) -> Result<FeedUpdate, FeedError> {
    let m = decode_message(bytes)?;
    Ok(FeedUpdate {
        epoch: m.epoch,
        cursor: m.cursor,
        snapshot: matches!(m.kind, FeedKind::Page { number: 0, .. }),
        pods_unchanged: m.pods.is_none(),
        pods: m.pods.unwrap_or_default(),
        load: m.load,
        pods_version: m.pods_version,
        ops: m.ops,
    })
}

/// Decodes a learned batch; never panics.
pub fn decode_learned(bytes: &[u8]) -> Result<LearnedBatch, FeedError> {
    let mut r = Reader::new(bytes);
    let flags = header(&mut r, LEARNED_MAGIC, LEARNED_VERSION)?;
    if flags != 0 {
        return Err(FeedError::UnknownFlags(flags));
    }
    let n = r.u32("learned entries")?;
    let n = r.checked_count(u64::from(n), MIN_LEARNED_ENTRY_BYTES, "learned entries")?;
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let len = r.u32("address")?;
        let len = r.checked_count(u64::from(len), 1, "address")?;
        let address = r.str(len, "address")?;
        let n = r.u32("hashes")?;
        let hashes = r.u64s(n as usize, "hashes")?;
        entries.push((address, hashes.into_iter().map(BlockHash::new).collect()));
    }
    finish(&r)?;
    Ok(LearnedBatch { entries })
}
