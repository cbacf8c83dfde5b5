//! Writing feed messages, full updates between VMs, and learned batches;
//! the pod and load lists' version digests (hashes of their encoding).

use super::packed_keys::put_packed;
use super::{
    BlockOp, FeedKind, FeedMessage, FeedUpdate, LearnedBatch, PodInfo, PodLoad, FEED_MAGIC,
    FEED_VERSION, FLAG_LOAD, FLAG_MORE, FLAG_PAGE, FLAG_PODS, LEARNED_MAGIC, LEARNED_VERSION,
    OP_BITS, OP_CLEARED, OP_REMOVED,
};
use crate::codec::{self, KEY_BYTES};
use xxhash_rust::xxh3::xxh3_64;

/// Digest of what identifies the pod list (addresses, models, capacities,
/// speeds, in order): a consumer holding the list of this version is not sent it again.
/// Never 0, which a consumer sends when it holds no list.
pub fn pods_version(pods: &[PodInfo]) -> u64 {
    let mut bytes = Vec::with_capacity(pods.len() * 40);
    for pod in pods {
        put_pod_identity(&mut bytes, pod);
    }
    xxh3_64(&bytes).max(1)
}

/// A pod's address, models, capacity and speed: its list entry without the
/// load, and what [`pods_version`] digests.
fn put_pod_identity(out: &mut Vec<u8>, pod: &PodInfo) {
    put_str(out, &pod.address);
    codec::put_varint(out, pod.models.len() as u64);
    for model in &pod.models {
        put_str(out, model);
    }
    codec::put_varint(out, u64::from(pod.capacity_blocks));
    codec::put_u32(out, pod.speed.to_bits());
}

/// Digest of the pods' load (in order); never 0.
pub fn load_version(pods: &[PodInfo]) -> u64 {
    let mut bytes = Vec::with_capacity(pods.len() * 8);
    for pod in pods {
        put_load(&mut bytes, &pod.load());
    }
    xxh3_64(&bytes).max(1)
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    codec::put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_load(out: &mut Vec<u8>, load: &PodLoad) {
    codec::put_varint(out, u64::from(load.waiting));
    codec::put_varint(out, u64::from(load.running));
    codec::put_u32(out, load.kv_usage.to_bits());
}

fn put_header(out: &mut Vec<u8>, magic: [u8; 4], version: u16, flags: u16) {
    out.extend_from_slice(&magic);
    codec::put_u16(out, version);
    codec::put_u16(out, flags);
}

/// Upper bound of the bytes `ops` take (plain keys).
fn ops_len(ops: &[BlockOp]) -> usize {
    ops.iter()
        .map(|op| {
            let n = op.hashes().len();
            5 + codec::varint_len(n as u64) + KEY_BYTES * n
        })
        .sum()
}

/// Encodes one answer of `GET /v1/feed`. Hashes are written as their index
/// keys (the bits above [`crate::hash::INDEX_KEY_BITS`] are not sent).
pub fn encode_message(m: &FeedMessage) -> Vec<u8> {
    let lists = match (&m.pods, &m.load) {
        (Some(pods), _) => Lists::Pods(pods),
        (None, Some(load)) => Lists::Load(load),
        (None, None) => Lists::None,
    };
    encode_parts(m, lists, &m.ops)
}

/// Encodes a complete update, as the VMs of one proxy pass it on: the pod
/// list when it changed, else the load when only that changed.
pub fn encode(update: &FeedUpdate) -> Vec<u8> {
    encode_lists(
        update.epoch,
        update.cursor,
        update.snapshot,
        update.pods_version,
        update.lists(),
        &update.ops,
    )
}

/// Encodes what [`decode`](super::decode) reads as a [`FeedUpdate`] of
/// `lists` for the list of digest `pods_version`, and no block operations,
/// from borrowed lists: the singleton forwards what it keeps without
/// copying it first.
pub fn encode_forward(
    epoch: u64,
    cursor: u64,
    snapshot: bool,
    pods_version: u64,
    lists: Lists<'_>,
) -> Vec<u8> {
    encode_lists(epoch, cursor, snapshot, pods_version, lists, &[])
}

fn encode_lists(
    epoch: u64,
    cursor: u64,
    snapshot: bool,
    pods_version: u64,
    lists: Lists<'_>,
    ops: &[BlockOp],
) -> Vec<u8> {
    let head = FeedMessage {
        epoch,
        cursor,
        pods_version,
        kind: if snapshot {
            FeedKind::Page {
                number: 0,
                next: None,
            }
        } else {
            FeedKind::Delta { more: false }
        },
        ..FeedMessage::default()
    };
    encode_parts(&head, lists, ops)
}

/// What a feed message carries besides its block operations.
#[derive(Debug, Clone, Copy)]
pub enum Lists<'a> {
    /// The pod list with its load.
    Pods(&'a [PodInfo]),
    /// Only the pods' load, in the order of the list last sent.
    Load(&'a [PodLoad]),
    None,
}

/// Encodes `head`'s header fields with `lists` and `ops` (those of `head` are ignored).
fn encode_parts(head: &FeedMessage, lists: Lists<'_>, ops: &[BlockOp]) -> Vec<u8> {
    let mut out = Vec::with_capacity(48 + ops_len(ops));
    let mut flags = match lists {
        Lists::Pods(_) => FLAG_PODS,
        Lists::Load(_) => FLAG_LOAD,
        Lists::None => 0,
    };
    if matches!(head.kind, FeedKind::Page { .. }) {
        flags |= FLAG_PAGE;
    }
    if matches!(
        head.kind,
        FeedKind::Delta { more: true } | FeedKind::Page { next: Some(_), .. }
    ) {
        flags |= FLAG_MORE;
    }
    put_header(&mut out, FEED_MAGIC, FEED_VERSION, flags);
    codec::put_u64(&mut out, head.epoch);
    codec::put_u64(&mut out, head.cursor);
    codec::put_u64(&mut out, head.pods_version);
    codec::put_u64(&mut out, head.load_version);
    if let FeedKind::Page { number, next } = head.kind {
        codec::put_u32(&mut out, number);
        if let Some(token) = next {
            codec::put_u64(&mut out, token.start);
            match token.after {
                Some(after) => {
                    out.push(1);
                    codec::put_u64(&mut out, after);
                }
                None => out.push(0),
            }
        }
    }
    match lists {
        Lists::Pods(pods) => {
            codec::put_varint(&mut out, pods.len() as u64);
            for pod in pods {
                put_pod_identity(&mut out, pod);
                put_load(&mut out, &pod.load());
            }
        }
        Lists::Load(load) => {
            codec::put_varint(&mut out, load.len() as u64);
            for l in load {
                put_load(&mut out, l);
            }
        }
        Lists::None => {}
    }
    codec::put_varint(&mut out, ops.len() as u64);
    for op in ops {
        let code = match op {
            BlockOp::Stored { tier, .. } => tier.code(),
            BlockOp::Removed { .. } => OP_REMOVED,
            BlockOp::Cleared { .. } => OP_CLEARED,
        };
        codec::put_varint(&mut out, u64::from(op.pod()) << OP_BITS | u64::from(code));
        if let BlockOp::Stored { hashes, .. } | BlockOp::Removed { hashes, .. } = op {
            codec::put_varint(&mut out, hashes.len() as u64);
            let mut keys: Vec<u64> = hashes.iter().map(|key| key.get()).collect();
            keys.sort_unstable();
            put_packed(&mut out, &keys);
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
    put_header(&mut out, LEARNED_MAGIC, LEARNED_VERSION, 0);
    // Lengths beyond u32 cannot occur (addresses, bounded batches); they are cut to it.
    let len32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let n = len32(batch.entries.len());
    codec::put_u32(&mut out, n);
    for (address, hashes) in batch.entries.iter().take(n as usize) {
        let a = len32(address.len());
        codec::put_u32(&mut out, a);
        out.extend_from_slice(address.as_bytes().get(..a as usize).unwrap_or_default());
        let h = len32(hashes.len());
        codec::put_u32(&mut out, h);
        for hash in hashes.iter().take(h as usize) {
            codec::put_u64(&mut out, hash.get());
        }
    }
    out
}
