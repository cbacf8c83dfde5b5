//! The index as the singleton publishes it in Envoy's shared data, one
//! copy per proxy process, and the reader the worker VMs look it up with.
//!
//! Keys, all under `kvroute/index/v1/` (shared data never deletes a key, so
//! the key set is bounded by the budget: one key per bucket, one per
//! [`SETS_PER_CHUNK`] set ids, and two more):
//! - `head`: the format, the writer (drawn at its start), its heartbeat, the
//!   publication's number, the pod table's version, the bucket count and the
//!   learned-age clock. Written last by every publication.
//! - `changes`: which buckets and chunks the last publications rewrote
//!   ([`super::changes`]), written just before the head by a publication
//!   that rewrote any key (not by a heartbeat). A reader keeps its
//!   copies of buckets and chunks until a publication rewrites them.
//! - `pods`: per index pod id, its generations and address.
//! - `b/<bucket>`: the bucket's slots and their ages (written once by each
//!   new writer or layout, then when they change). A write-through writer
//!   ([`BlockIndex::write_through`]) reads its buckets back from here.
//! - `s/<chunk>`: the interned sets of ids `chunk × 16 ..`, members sorted.
//!
//! A flush writes the pod table, then new sets, then buckets, so a reader
//! never meets a slot whose set is not written yet. Every decoder here takes
//! any bytes without panicking: what does not decode is a miss, counted.

use super::bucket::{bucket_of, probe_slots, slot_set, Bucket, BUCKET_SLOTS, EMPTY};
use super::changes::{ChangeLog, CHANGES_KEY};
use super::member::{Clock, Member, PodId, PodState};
use super::{BlockIndex, IndexSource};
use crate::codec::{put_u16, put_u32, put_u64, CodecError, Reader};
use hashbrown::HashMap;
use std::borrow::Cow;
use std::cell::{Cell, RefCell};

/// The head key: what a reader needs to read the rest.
pub const HEAD_KEY: &str = "kvroute/index/v1/head";
/// The pod table key.
pub const PODS_KEY: &str = "kvroute/index/v1/pods";
/// Interned sets per shared-data key.
pub const SETS_PER_CHUNK: u32 = 16;
/// The head's format byte (2: buckets carry their slots' ages; 3: the head
/// numbers its publication).
const FORMAT: u8 = 3;

/// The key of bucket `b`.
pub fn bucket_key(b: usize) -> String {
    format!("kvroute/index/v1/b/{b}")
}

/// The key of the chunk holding set `id`.
pub fn set_chunk_key(id: u32) -> String {
    format!("kvroute/index/v1/s/{}", id / SETS_PER_CHUNK)
}

/// What the head key says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// Drawn by each writer when it starts: a pod-table version of another
    /// writer means nothing.
    pub writer: u64,
    /// When the writer last flushed (ms since the epoch).
    pub heartbeat_ms: u64,
    /// The writer's publications that rewrote a key so far: one flush
    /// publishes in batches within a millisecond, and the head of each batch
    /// that rewrote a key must differ from the last.
    pub publication: u64,
    /// Bumped whenever the pod table is rewritten.
    pub pods_version: u64,
    pub buckets: u32,
    pub clock: Clock,
}

impl Head {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(43);
        out.push(FORMAT);
        put_u64(&mut out, self.writer);
        put_u64(&mut out, self.heartbeat_ms);
        put_u64(&mut out, self.publication);
        put_u64(&mut out, self.pods_version);
        put_u32(&mut out, self.buckets);
        put_u32(&mut out, self.clock.epoch_seconds);
        put_u16(&mut out, self.clock.ttl_epochs);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Head, CodecError> {
        let mut r = Reader::new(bytes);
        if r.u8("head format")? != FORMAT {
            return Err(CodecError::Truncated {
                what: "head of a known format",
            });
        }
        let head = Head {
            writer: r.u64("writer")?,
            heartbeat_ms: r.u64("heartbeat")?,
            publication: r.u64("publication")?,
            pods_version: r.u64("pods version")?,
            buckets: r.u32("bucket count")?,
            clock: Clock {
                epoch_seconds: r.u32("epoch seconds")?.max(1),
                ttl_epochs: r.u16("ttl epochs")?,
            },
        };
        if head.buckets == 0 {
            return Err(CodecError::Truncated {
                what: "a non-zero bucket count",
            });
        }
        Ok(head)
    }
}

/// The published pods: per index pod id, its generations and address.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodTable {
    pods: Vec<Option<(PodState, String)>>,
}

impl PodTable {
    pub fn decode(bytes: &[u8]) -> Result<PodTable, CodecError> {
        let mut r = Reader::new(bytes);
        let count = r.u32("pod count")?;
        let count = r.checked_count(u64::from(count), 1, "pods")?;
        let mut pods = Vec::with_capacity(count);
        for _ in 0..count {
            if r.u8("pod present")? == 0 {
                pods.push(None);
                continue;
            }
            let state = PodState {
                learned_generation: r.u32("learned generation")?,
                precise_generation: r.u32("precise generation")?,
            };
            let len = usize::from(r.u16("address length")?);
            pods.push(Some((state, r.str(len, "address")?)));
        }
        Ok(PodTable { pods })
    }

    /// Every pod: (index id, address).
    pub fn addresses(&self) -> impl Iterator<Item = (PodId, &str)> {
        self.pods
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().map(|(_, a)| (PodId(i as u32), a.as_str())))
    }

    /// How many ids the table spans (removed pods included).
    pub fn id_span(&self) -> usize {
        self.pods.len()
    }
}

/// A bucket as published: its slot count, its slots, then their ages.
pub(super) fn encode_bucket(bucket: &Bucket) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + bucket.slots.len() * 9);
    put_u16(&mut out, bucket.slots.len() as u16);
    for &slot in &bucket.slots {
        put_u64(&mut out, slot);
    }
    out.extend_from_slice(&bucket.ages);
    out
}

/// A published bucket's slot count, slot bytes and ages; an error when the
/// bytes are not a bucket.
fn split_bucket(bytes: &[u8]) -> Result<(usize, &[u8], &[u8]), CodecError> {
    let mut r = Reader::new(bytes);
    let len = usize::from(r.u16("slot count")?);
    let slots = r.take(len.saturating_mul(8), "slots")?;
    let ages = r.take(len, "ages")?;
    if !r.is_empty() || len > BUCKET_SLOTS || (len > 0 && !len.is_power_of_two()) {
        return Err(CodecError::Truncated {
            what: "a bucket of the published shape",
        });
    }
    Ok((len, slots, ages))
}

fn slot_in(slots: &[u8], i: usize) -> u64 {
    slots
        .get(i * 8..i * 8 + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(EMPTY, u64::from_le_bytes)
}

/// The set reference of `key` in a published bucket; an error when the
/// bytes are not a bucket.
pub fn find_in_bucket(bytes: &[u8], key: u64) -> Result<Option<u32>, CodecError> {
    let (len, slots, _) = split_bucket(bytes)?;
    Ok(probe_slots(len, key, |i| slot_in(slots, i))
        .ok()
        .map(|i| slot_set(slot_in(slots, i))))
}

/// A published bucket as the writer keeps it; an error when the bytes are
/// not a bucket.
pub(super) fn decode_bucket(bytes: &[u8]) -> Result<Bucket, CodecError> {
    let (len, slots, ages) = split_bucket(bytes)?;
    let slots: Vec<u64> = (0..len).map(|i| slot_in(slots, i)).collect();
    Ok(Bucket {
        len: slots.iter().filter(|&&s| s != EMPTY).count(),
        slots,
        ages: ages.to_vec(),
    })
}

/// The members of set `id` in a published chunk (`None`: not in it); an
/// error when the bytes are not a chunk.
pub fn find_in_chunk(bytes: &[u8], id: u32) -> Result<Option<Vec<Member>>, CodecError> {
    let mut r = Reader::new(bytes);
    while !r.is_empty() {
        let at = r.u32("set id")?;
        let n = usize::from(r.u16("member count")?);
        if at == id {
            return Ok(Some(
                r.u64s(n, "members")?
                    .into_iter()
                    .map(Member::from_bits)
                    .collect(),
            ));
        }
        r.take(n.saturating_mul(8), "members")?;
    }
    Ok(None)
}

/// Key writes of one flush, in the order they must be applied.
#[derive(Debug, Default)]
pub struct Publication {
    pub writes: Vec<(String, Vec<u8>)>,
    /// Changed keys left for the next flush (the per-flush bound was reached).
    pub deferred: usize,
}

impl BlockIndex {
    /// Drains what changed since the last publication into at most
    /// `max_writes` key writes (plus the head): the pod table when a pod was
    /// added, removed or cleared, the chunks of new sets, changed buckets,
    /// then buckets this index never wrote. Buckets wait while new sets do
    /// (a slot is never published before its set). `address` names each
    /// live pod. A write-through index keeps the buckets it wrote in its
    /// working set, now clean: the caller stores the writes before the
    /// index's next write.
    pub fn publish(
        &mut self,
        max_writes: usize,
        writer: u64,
        heartbeat_ms: u64,
        address: &dyn Fn(PodId) -> Option<String>,
    ) -> Publication {
        let mut out = Publication::default();
        if self.pods_dirty {
            self.pods_dirty = false;
            self.pods_version += 1;
            out.writes
                .push((PODS_KEY.to_string(), self.encode_pods(address)));
        }
        let mut changed = std::mem::take(&mut self.written_early);
        let chunks = self.sets.fresh_chunks();
        let room = max_writes.saturating_sub(out.writes.len());
        for &chunk in chunks.iter().take(room) {
            out.writes.push((
                set_chunk_key(chunk * SETS_PER_CHUNK),
                self.encode_chunk(chunk),
            ));
            changed.note_chunk(chunk);
        }
        if chunks.len() > room {
            // Re-queued as one id per chunk: the chunk is rewritten whole.
            let left = &chunks[room..];
            self.sets.requeue_chunks(left);
            out.deferred = left.len() + self.dirty_buckets.len() + self.unpublished.len();
        } else {
            let room = max_writes.saturating_sub(out.writes.len());
            let take = room.min(self.dirty_buckets.len());
            let rest = self.dirty_buckets.split_off(take);
            for b in std::mem::replace(&mut self.dirty_buckets, rest) {
                let b = b as usize;
                self.bucket_dirty[b] = false;
                self.published[b] = true;
                out.writes
                    .push((bucket_key(b), encode_bucket(&self.buckets[b])));
                changed.note_bucket(b as u32);
            }
            // Then the buckets not written yet, with the room left.
            while out.writes.len() < max_writes {
                let Some(b) = self.unpublished.pop() else {
                    break;
                };
                let b = b as usize;
                if !std::mem::replace(&mut self.published[b], true) {
                    out.writes
                        .push((bucket_key(b), encode_bucket(&self.buckets[b])));
                    changed.note_bucket(b as u32);
                }
            }
            out.deferred = self.dirty_buckets.len() + self.unpublished.len();
        }
        // A publication that rewrote nothing (a heartbeat) keeps its number
        // and the log as they are: readers then neither read the log nor drop
        // anything, and the writer does not re-encode it ten times a second.
        if !out.writes.is_empty() || changed.ids() > 0 {
            self.publications += 1;
            changed.publication = self.publications;
            self.changes.record(changed);
            out.writes
                .push((CHANGES_KEY.to_string(), self.changes.encode()));
        }
        let head = Head {
            writer,
            heartbeat_ms,
            publication: self.publications,
            pods_version: self.pods_version,
            buckets: self.buckets.len() as u32,
            clock: self.clock(),
        };
        out.writes.push((HEAD_KEY.to_string(), head.encode()));
        out
    }

    fn encode_pods(&self, address: &dyn Fn(PodId) -> Option<String>) -> Vec<u8> {
        let mut out = Vec::new();
        put_u32(&mut out, self.pods.len() as u32);
        for (i, state) in self.pods.iter().enumerate() {
            let id = PodId(i as u32);
            let named =
                address(id).filter(|a| !self.free_pods.contains(&id.0) && a.len() <= 0xffff);
            match named {
                Some(address) => {
                    out.push(1);
                    put_u32(&mut out, state.learned_generation);
                    put_u32(&mut out, state.precise_generation);
                    put_u16(&mut out, address.len() as u16);
                    out.extend_from_slice(address.as_bytes());
                }
                None => out.push(0),
            }
        }
        out
    }

    pub(super) fn encode_chunk(&self, chunk: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let first = chunk * SETS_PER_CHUNK;
        for id in first..first + SETS_PER_CHUNK {
            let members = self.sets.get(id);
            if members.is_empty() {
                continue;
            }
            put_u32(&mut out, id);
            put_u16(&mut out, members.len() as u16);
            for m in members {
                put_u64(&mut out, m.bits());
            }
        }
        out
    }
}

/// Reads shared data by key (the host in a worker VM, a map in tests).
pub trait KeyReader {
    fn read(&self, key: &str) -> Option<Vec<u8>>;
}

/// Reads and writes shared data by key: where a write-through writer keeps
/// its buckets between flushes (the host in the singleton, a map in tests).
pub trait KeyStore: KeyReader {
    /// False when the value was not stored.
    fn write(&self, key: &str, value: &[u8]) -> bool;
}

/// Why a worker cannot read the published index: it then routes on load only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unpublished {
    /// No head: no singleton has published (none configured, or not yet).
    Absent,
    /// The head's heartbeat is older than the staleness limit: the writer stopped.
    Stale,
    /// The head or the pod table does not decode.
    Unreadable,
}

impl Unpublished {
    pub fn name(self) -> &'static str {
        match self {
            Unpublished::Absent => "absent",
            Unpublished::Stale => "stale",
            Unpublished::Unreadable => "unreadable",
        }
    }
}

/// Bytes of buckets and chunks a worker keeps between its decisions.
pub const READ_CACHE_BYTES: usize = 1 << 20;

/// A worker's view of the published index: the head and the pod table,
/// re-read when the writer changes them, and the buckets and chunks its
/// lookups read that no publication rewrote since.
#[derive(Debug, Default)]
pub struct PublishedView {
    head: Option<Head>,
    /// The head as last read: the writer rewrites it at every flush, after
    /// the flush's buckets and chunks.
    head_bytes: Vec<u8>,
    pods: PodTable,
    cache: RefCell<ReadCache>,
}

/// Published values a reader keeps: each until a publication rewrites its
/// key (the change log says which), so a value is as fresh as a new read
/// under the same head. Bounded by [`READ_CACHE_BYTES`]; emptied when full.
#[derive(Debug, Default)]
struct ReadCache {
    buckets: HashMap<u32, Vec<u8>>,
    chunks: HashMap<u32, Vec<u8>>,
    bytes: usize,
}

impl ReadCache {
    fn clear(&mut self) {
        self.buckets.clear();
        self.chunks.clear();
        self.bytes = 0;
    }

    /// Drops value `n` of `kind` (see [`PublishedIndex::with_value`]).
    fn forget(&mut self, kind: fn(&mut ReadCache) -> &mut HashMap<u32, Vec<u8>>, n: u32) {
        if let Some(old) = kind(self).remove(&n) {
            self.bytes = self.bytes.saturating_sub(old.len());
        }
    }

    /// Makes room for `len` more bytes (emptying the cache when full);
    /// false when a value of that size is never kept.
    fn room_for(&mut self, len: usize) -> bool {
        if len > READ_CACHE_BYTES / 4 {
            return false;
        }
        if self.bytes + len > READ_CACHE_BYTES {
            self.clear();
        }
        self.bytes += len;
        true
    }
}

impl PublishedView {
    /// Reads the head (one key) and, when its version moved, the pod table.
    /// An error says why the index cannot be used now.
    pub fn refresh(
        &mut self,
        reader: &dyn KeyReader,
        now_ms: u64,
        stale_after_ms: u64,
    ) -> Result<(), Unpublished> {
        let Some(bytes) = reader.read(HEAD_KEY) else {
            self.head = None;
            return Err(Unpublished::Absent);
        };
        let head = Head::decode(&bytes).map_err(|_| Unpublished::Unreadable)?;
        if now_ms.saturating_sub(head.heartbeat_ms) > stale_after_ms {
            return Err(Unpublished::Stale);
        }
        if bytes != self.head_bytes {
            self.forget_rewritten(reader, &head);
            self.head_bytes = bytes;
        }
        if self.pods_version() != Some((head.writer, head.pods_version)) {
            let table = reader.read(PODS_KEY).ok_or(Unpublished::Unreadable)?;
            self.pods = PodTable::decode(&table).map_err(|_| Unpublished::Unreadable)?;
        }
        self.head = Some(head);
        Ok(())
    }

    /// Drops the kept buckets and chunks that publications after the one
    /// they were read under rewrote, or all of them when the writer, the
    /// layout or the clock changed, or the writer's log no longer lists
    /// every publication since.
    fn forget_rewritten(&mut self, reader: &dyn KeyReader, head: &Head) {
        let cache = self.cache.get_mut();
        let same_layout = self.head.is_some_and(|read_under| {
            read_under.writer == head.writer
                && read_under.buckets == head.buckets
                && read_under.clock == head.clock
                && read_under.publication <= head.publication
        });
        let forgotten = match self.head.filter(|_| same_layout) {
            Some(read_under) if read_under.publication == head.publication => Some(()),
            Some(read_under) => reader
                .read(CHANGES_KEY)
                .and_then(|bytes| ChangeLog::decode(&bytes).ok())
                .and_then(|log| {
                    for changed in log.between(read_under.publication, head.publication)? {
                        for &b in &changed.buckets {
                            cache.forget(|c| &mut c.buckets, b);
                        }
                        for &chunk in &changed.chunks {
                            cache.forget(|c| &mut c.chunks, chunk);
                        }
                    }
                    Some(())
                }),
            None => None,
        };
        if forgotten.is_none() {
            cache.clear();
        }
    }

    /// The writer and version of the pod table last read (to cache what
    /// depends on it).
    pub fn pods_version(&self) -> Option<(u64, u64)> {
        self.head.map(|h| (h.writer, h.pods_version))
    }

    pub fn pods(&self) -> &PodTable {
        &self.pods
    }

    /// A lookup source over `reader`, once [`PublishedView::refresh`] succeeded.
    pub fn source<'a>(&'a self, reader: &'a dyn KeyReader) -> Option<PublishedIndex<'a>> {
        Some(PublishedIndex {
            reader,
            head: self.head?,
            pods: &self.pods,
            cache: &self.cache,
            unreadable: Cell::new(0),
            reads: Cell::new(0),
            reused: Cell::new(0),
        })
    }
}

/// The published index as a lookup source: every probe reads one bucket key,
/// every set met one chunk key, unless the view read it under this head.
pub struct PublishedIndex<'a> {
    reader: &'a dyn KeyReader,
    head: Head,
    pods: &'a PodTable,
    cache: &'a RefCell<ReadCache>,
    unreadable: Cell<u64>,
    reads: Cell<u64>,
    reused: Cell<u64>,
}

impl PublishedIndex<'_> {
    /// Buckets and chunks that did not decode (each counted a miss).
    pub fn unreadable(&self) -> u64 {
        self.unreadable.get()
    }

    /// Buckets and chunks read from the store, and those the view already held.
    pub fn reads(&self) -> (u64, u64) {
        (self.reads.get(), self.reused.get())
    }

    fn count_unreadable(&self) {
        self.unreadable.set(self.unreadable.get() + 1);
    }

    /// `answer` applied to the value of `key` (number `n` of its kind in
    /// `kind`), from the cache or read and kept. `fresh` reads the store
    /// even when the cache holds the key.
    fn with_value<T>(
        &self,
        kind: fn(&mut ReadCache) -> &mut HashMap<u32, Vec<u8>>,
        n: u32,
        key: impl FnOnce() -> String,
        fresh: bool,
        answer: impl Fn(&[u8]) -> T,
    ) -> Option<T> {
        let mut cache = self.cache.borrow_mut();
        if !fresh {
            if let Some(bytes) = kind(&mut cache).get(&n) {
                self.reused.set(self.reused.get() + 1);
                return Some(answer(bytes));
            }
        }
        self.reads.set(self.reads.get() + 1);
        let bytes = self.reader.read(&key())?;
        let found = answer(&bytes);
        if cache.room_for(bytes.len()) {
            if let Some(old) = kind(&mut cache).insert(n, bytes) {
                cache.bytes = cache.bytes.saturating_sub(old.len());
            }
        }
        Some(found)
    }
}

impl IndexSource for PublishedIndex<'_> {
    fn set_of(&self, key: u64) -> Option<u32> {
        let b = bucket_of(key, self.head.buckets as usize);
        let found = self.with_value(
            |c| &mut c.buckets,
            b as u32,
            || bucket_key(b),
            false,
            |bytes| find_in_bucket(bytes, key),
        )?;
        found.unwrap_or_else(|_| {
            self.count_unreadable();
            None
        })
    }

    fn members(&self, id: u32) -> Cow<'_, [Member]> {
        let chunk = id / SETS_PER_CHUNK;
        let read = |fresh| {
            self.with_value(
                |c| &mut c.chunks,
                chunk,
                || set_chunk_key(id),
                fresh,
                |bytes| find_in_chunk(bytes, id),
            )
        };
        // A set interned after the kept chunk was read is read again.
        let found = match read(false) {
            Some(Ok(None)) => read(true),
            other => other,
        };
        match found {
            Some(Ok(Some(members))) => Cow::Owned(members),
            Some(Err(_)) => {
                self.count_unreadable();
                Cow::Borrowed(&[])
            }
            _ => Cow::Borrowed(&[]),
        }
    }

    fn pod_state(&self, pod: PodId) -> Option<PodState> {
        self.pods
            .pods
            .get(pod.slot())?
            .as_ref()
            .map(|(state, _)| *state)
    }

    fn clock(&self) -> Clock {
        self.head.clock
    }
}
