//! Which buckets and set chunks the last publications rewrote. The writer
//! publishes this log beside the head, so that a reader keeps every value it
//! read that no later publication rewrote, instead of dropping them all at
//! each flush (every flush writes a new head, heartbeat included).

use crate::codec::{put_u32, put_u64, CodecError, Reader};
use std::collections::VecDeque;

/// The key of the log.
pub const CHANGES_KEY: &str = "kvroute/index/v1/changes";
/// Ids the log keeps (16 KiB encoded); the oldest publications' lists go
/// first. A reader further behind forgets everything it read.
const MAX_IDS: usize = 4096;

/// The keys one publication rewrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changed {
    pub publication: u64,
    pub buckets: Vec<u32>,
    pub chunks: Vec<u32>,
}

impl Changed {
    pub(super) fn ids(&self) -> usize {
        self.buckets.len() + self.chunks.len()
    }

    /// Notes a rewritten bucket. Past what a log can list the ids are not
    /// kept (the publication then makes readers forget everything anyway),
    /// so a long run of write-backs between publications stays bounded.
    pub fn note_bucket(&mut self, b: u32) {
        if self.ids() <= MAX_IDS {
            self.buckets.push(b);
        }
    }

    /// Notes a rewritten set chunk (bounded as [`Changed::note_bucket`]).
    pub fn note_chunk(&mut self, chunk: u32) {
        if self.ids() <= MAX_IDS {
            self.chunks.push(chunk);
        }
    }
}

/// The writer's log of its last publications that rewrote anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeLog {
    /// Every publication from this one on that rewrote a key is listed.
    complete_from: u64,
    /// The last publication recorded: a reader whose head is newer (this
    /// log's write failed) cannot trust it.
    latest: u64,
    /// Oldest first.
    entries: VecDeque<Changed>,
    ids: usize,
}

impl ChangeLog {
    /// An empty log that vouches for no publication before `first`.
    pub fn starting_at(first: u64) -> ChangeLog {
        ChangeLog {
            complete_from: first,
            latest: first.saturating_sub(1),
            entries: VecDeque::new(),
            ids: 0,
        }
    }

    /// Records what a publication rewrote; publications come in order.
    pub fn record(&mut self, changed: Changed) {
        self.latest = changed.publication;
        let n = changed.ids();
        if n == 0 {
            return;
        }
        if n > MAX_IDS {
            self.entries.clear();
            self.ids = 0;
            self.complete_from = changed.publication + 1;
            return;
        }
        self.ids += n;
        self.entries.push_back(changed);
        while self.ids > MAX_IDS {
            let Some(old) = self.entries.pop_front() else {
                break;
            };
            self.ids -= old.ids();
            self.complete_from = old.publication + 1;
        }
    }

    /// What the publications after `seen` up to `head` rewrote; `None` when
    /// the log does not list all of them.
    pub fn between(&self, seen: u64, head: u64) -> Option<impl Iterator<Item = &Changed>> {
        (self.complete_from <= seen.saturating_add(1) && self.latest >= head)
            .then(|| self.entries.iter().filter(move |c| c.publication > seen))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(20 + self.entries.len() * 16 + self.ids * 4);
        put_u64(&mut out, self.complete_from);
        put_u64(&mut out, self.latest);
        put_u32(&mut out, self.entries.len() as u32);
        for c in &self.entries {
            put_u64(&mut out, c.publication);
            for ids in [&c.buckets, &c.chunks] {
                put_u32(&mut out, ids.len() as u32);
                for &id in ids {
                    put_u32(&mut out, id);
                }
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<ChangeLog, CodecError> {
        let mut r = Reader::new(bytes);
        let complete_from = r.u64("first listed publication")?;
        let latest = r.u64("latest publication")?;
        let count = r.u32("publications")?;
        let count = r.checked_count(u64::from(count), 16, "publications")?;
        let mut entries = VecDeque::with_capacity(count);
        let mut ids = 0;
        for _ in 0..count {
            let publication = r.u64("publication")?;
            let mut read_ids = |what: &'static str| -> Result<Vec<u32>, CodecError> {
                let n = r.u32(what)?;
                let n = r.checked_count(u64::from(n), 4, what)?;
                (0..n).map(|_| r.u32(what)).collect()
            };
            let buckets = read_ids("rewritten buckets")?;
            let chunks = read_ids("rewritten chunks")?;
            ids += buckets.len() + chunks.len();
            entries.push_back(Changed {
                publication,
                buckets,
                chunks,
            });
        }
        if !r.is_empty() {
            return Err(CodecError::Truncated {
                what: "a change log without trailing bytes",
            });
        }
        Ok(ChangeLog {
            complete_from,
            latest,
            entries,
            ids,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changed(publication: u64, buckets: &[u32], chunks: &[u32]) -> Changed {
        Changed {
            publication,
            buckets: buckets.to_vec(),
            chunks: chunks.to_vec(),
        }
    }

    /// What a reader that saw `seen` drops, for a head at the log's latest.
    fn listed(log: &ChangeLog, seen: u64) -> Option<Vec<u64>> {
        log.between(seen, log.latest)
            .map(|c| c.map(|c| c.publication).collect())
    }

    #[test]
    fn lists_what_came_after_a_publication_while_it_covers_it() {
        let mut log = ChangeLog::starting_at(5);
        // Before the log's first publication: nothing vouched for.
        assert_eq!(listed(&log, 3), None);
        assert_eq!(listed(&log, 4), Some(vec![]));
        log.record(changed(5, &[1, 2], &[]));
        log.record(changed(6, &[], &[]));
        log.record(changed(7, &[3], &[9]));
        assert_eq!(listed(&log, 4), Some(vec![5, 7]));
        assert_eq!(listed(&log, 5), Some(vec![7]));
        assert_eq!(listed(&log, 7), Some(vec![]));
        // A head newer than the log (its write failed): not trusted.
        assert!(log.between(5, 8).is_none());
        let decoded = ChangeLog::decode(&log.encode()).unwrap();
        assert_eq!(decoded, log);
    }

    #[test]
    fn drops_the_oldest_lists_beyond_its_bound() {
        let mut log = ChangeLog::starting_at(1);
        let half: Vec<u32> = (0..MAX_IDS as u32 / 2).collect();
        log.record(changed(1, &half, &[]));
        log.record(changed(2, &half, &[]));
        assert_eq!(listed(&log, 0), Some(vec![1, 2]));
        log.record(changed(3, &[7], &[]));
        // Publication 1's list went: a reader that saw only 0 forgets all.
        assert_eq!(listed(&log, 0), None);
        assert_eq!(listed(&log, 1), Some(vec![2, 3]));
        // A publication too large to list: nothing before it is vouched for.
        let all: Vec<u32> = (0..MAX_IDS as u32 + 1).collect();
        log.record(changed(4, &all, &[]));
        assert_eq!(listed(&log, 3), None);
        assert_eq!(listed(&log, 4), Some(vec![]));
        assert!(log.encode().len() <= 20 + 4 * (8 + 8) + MAX_IDS * 4);
    }

    #[test]
    fn a_publication_noting_more_than_a_log_lists_keeps_no_more_and_resets_the_log() {
        let mut many = Changed {
            publication: 9,
            ..Changed::default()
        };
        for b in 0..3 * MAX_IDS as u32 {
            many.note_bucket(b);
            many.note_chunk(b);
        }
        assert_eq!(many.ids(), MAX_IDS + 1);
        let mut log = ChangeLog::starting_at(1);
        log.record(changed(8, &[1], &[]));
        log.record(many);
        assert_eq!(listed(&log, 8), None);
        assert_eq!(listed(&log, 9), Some(vec![]));
    }

    #[test]
    fn refuses_bytes_that_are_not_a_log() {
        let mut log = ChangeLog::starting_at(1);
        log.record(changed(1, &[1, 2, 3], &[4]));
        let bytes = log.encode();
        for cut in 0..bytes.len() {
            assert!(ChangeLog::decode(&bytes[..cut]).is_err(), "{cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(ChangeLog::decode(&longer).is_err());
        let mut huge = bytes;
        huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(ChangeLog::decode(&huge).is_err());
    }
}
