//! Per-publisher sequencing: identity of a message, gaps, restarts, and the
//! replay that fills a gap (live messages buffered meanwhile).

use std::collections::BTreeMap;

use crate::vllm_wire::{decode_batch, decode_seq, parse_topic, DecodedBatch, EventBatch};

use super::feed_log::Sink;
use super::keys::PodKey;
use super::origin;
use super::sources::Group;
use super::{Incoming, Index, ReplayRequest};

pub(super) struct PendingReplay {
    id: u64,
    from: u64,
    buffered: Vec<(u64, EventBatch, u64)>,
}

/// One publisher: a data-parallel rank of a pod.
#[derive(Default)]
pub(super) struct Source {
    pub(super) next_seq: Option<u64>,
    /// KV-cache group (`group_idx`, 0 when absent) → its blocks.
    pub(super) groups: BTreeMap<i64, Group>,
    /// KV-cache groups whose spec kind is not routed on (their removals are ignored).
    pub(super) unrouted_groups: Vec<i64>,
    pub(super) replay: Option<PendingReplay>,
}

impl Index {
    /// Handles one ZMQ message. Returns a replay request when a gap should be
    /// filled from the pod's replay socket.
    pub fn handle(&mut self, m: &Incoming, now_ms: u64) -> Option<ReplayRequest> {
        self.metrics.messages_received.inc();
        let topic = std::str::from_utf8(&m.topic).ok().and_then(parse_topic);
        let (address, model): (&str, &str) = match (&m.identity, topic) {
            // Configured identity wins; a model it does not name may come from the topic.
            (Some((a, model)), t) if model.is_empty() => (a, t.map_or("", |t| t.model)),
            (Some((a, model)), _) => (a, model),
            (None, Some(t)) => (t.address, t.model),
            (None, None) => {
                self.metrics.rejected("no_identity");
                return None;
            }
        };
        let seq = match decode_seq(&m.seq) {
            Ok(s) => s,
            Err(e) => {
                self.metrics.decode_error(e.kind());
                return None;
            }
        };
        let batch = self.decode(&m.payload)?;
        let key = match self.by_address.get(address) {
            Some(&k) => k,
            None if self.cfg.accept_unknown_publishers => {
                self.add_pod(address, Some(model), origin::EVENTS, now_ms);
                match self.by_address.get(address) {
                    Some(&k) => k,
                    None => return None,
                }
            }
            None => {
                self.metrics.rejected("unknown_pod");
                return None;
            }
        };
        let names_no_model = self.pods.get_mut(&key).is_some_and(|pod| {
            pod.last_seen_ms = now_ms;
            pod.models.is_empty()
        });
        if names_no_model {
            self.add_model(key, model);
        }
        let rank = batch.data_parallel_rank.unwrap_or(0);
        self.sequence(key, rank, seq, batch, m.received_ms, now_ms)
    }

    /// Decodes a payload, counting the events it skipped; `None` (counted)
    /// when it is not a batch at all.
    fn decode(&self, payload: &[u8]) -> Option<EventBatch> {
        match decode_batch(payload) {
            Ok(DecodedBatch { batch, skipped }) => {
                for e in &skipped {
                    self.metrics.event_skipped(e.kind());
                }
                Some(batch)
            }
            Err(e) => {
                self.metrics.decode_error(e.kind());
                None
            }
        }
    }

    fn sequence(
        &mut self,
        key: PodKey,
        rank: i64,
        seq: u64,
        batch: EventBatch,
        received_ms: u64,
        now_ms: u64,
    ) -> Option<ReplayRequest> {
        let endpoint = self.replay_endpoint(key, rank);
        let replay_id = self.next_replay_id;
        let pod = self.pods.get_mut(&key)?;
        let source = pod.sources.entry(rank).or_default();
        if let Some(p) = &mut source.replay {
            if seq >= p.from {
                if p.buffered.len() < self.cfg.replay_buffer {
                    p.buffered.push((seq, batch, received_ms));
                    return None;
                }
                // Buffer full: give up on the replay, apply what we have.
                self.metrics.replay("abandoned");
                if let Some(p) = source.replay.take() {
                    self.flush_after_replay(key, rank, p, now_ms);
                }
                self.apply_in_order(key, rank, seq, batch, received_ms, now_ms);
                return None;
            }
            // A sequence below the replay start: the publisher restarted.
            source.replay = None;
        }
        // The first sequence that should have come: a gap starts there.
        let missing_from = match source.next_seq {
            Some(next) if seq > next => {
                self.metrics.seq_gaps.inc();
                self.metrics.seq_missed.inc_by(seq - next);
                Some(next)
            }
            Some(next) if seq < next => {
                self.metrics.restarts.inc();
                self.clear_source(key, rank);
                None
            }
            Some(_) => None,
            // Joined a running publisher (the indexer started after the pod):
            // what it published before is in its replay buffer.
            None if seq > 0 => {
                self.metrics.joined_midstream.inc();
                Some(0)
            }
            None => None,
        };
        if let Some(from) = missing_from {
            match (endpoint, self.pods.get_mut(&key)) {
                (Some(endpoint), Some(pod)) => {
                    self.next_replay_id += 1;
                    let source = pod.sources.entry(rank).or_default();
                    source.replay = Some(PendingReplay {
                        id: replay_id,
                        from,
                        buffered: vec![(seq, batch, received_ms)],
                    });
                    return Some(ReplayRequest {
                        pod: pod.address.clone(),
                        rank,
                        id: replay_id,
                        endpoint,
                        from_seq: from,
                    });
                }
                _ => {
                    if from > 0 {
                        self.metrics.seq_gaps_unrecovered.inc();
                    }
                }
            }
        }
        self.apply_seq(key, rank, seq, &batch, received_ms, now_ms);
        None
    }

    /// Applies what was buffered during a replay. The gap before the first
    /// buffered message was counted when it was detected (or was the join of
    /// a running publisher): if the replay left it open, it counts once more
    /// only as unrecovered.
    fn flush_after_replay(&mut self, key: PodKey, rank: i64, pending: PendingReplay, now_ms: u64) {
        let mut buffered = pending.buffered.into_iter();
        if let Some((seq, batch, received_ms)) = buffered.next() {
            let next = self
                .pods
                .get(&key)
                .and_then(|p| p.sources.get(&rank))
                .and_then(|s| s.next_seq)
                .unwrap_or(pending.from);
            if seq > next && pending.from > 0 {
                self.metrics.seq_gaps_unrecovered.inc();
            }
            if seq >= next {
                self.apply_seq(key, rank, seq, &batch, received_ms, now_ms);
            }
        }
        for (s, b, r) in buffered {
            self.apply_in_order(key, rank, s, b, r, now_ms);
        }
    }

    /// Applies a batch whose sequence follows, counts a gap or restart otherwise
    /// (no replay: used to flush buffers).
    fn apply_in_order(
        &mut self,
        key: PodKey,
        rank: i64,
        seq: u64,
        batch: EventBatch,
        received_ms: u64,
        now_ms: u64,
    ) {
        let next = self
            .pods
            .get(&key)
            .and_then(|p| p.sources.get(&rank))
            .and_then(|s| s.next_seq);
        match next {
            Some(n) if seq < n => return, // already applied (replay overlap)
            Some(n) if seq > n => {
                self.metrics.seq_gaps.inc();
                self.metrics.seq_missed.inc_by(seq - n);
                self.metrics.seq_gaps_unrecovered.inc();
            }
            _ => {}
        }
        self.apply_seq(key, rank, seq, &batch, received_ms, now_ms);
    }

    fn apply_seq(
        &mut self,
        key: PodKey,
        rank: i64,
        seq: u64,
        batch: &EventBatch,
        received_ms: u64,
        now_ms: u64,
    ) {
        let mut sink = Sink::default();
        self.apply_batch(key, rank, batch, &mut sink);
        if let Some(s) = self
            .pods
            .get_mut(&key)
            .and_then(|p| p.sources.get_mut(&rank))
        {
            s.next_seq = Some(seq.wrapping_add(1));
        }
        self.commit(sink);
        self.metrics
            .apply_lag_seconds
            .observe(now_ms.saturating_sub(received_ms) as f64 / 1000.0);
    }

    fn replay_endpoint(&self, key: PodKey, rank: i64) -> Option<String> {
        let pod = self.pods.get(&key)?;
        let offset = u16::try_from(rank).ok()?;
        if let Some(e) = &pod.replay_endpoint {
            let (base, port) = e.rsplit_once(':')?;
            let port: u16 = port.parse().ok()?;
            return Some(format!("{base}:{}", port.checked_add(offset)?));
        }
        let port = self.cfg.replay_port?.checked_add(offset)?;
        let (host, _) = pod.address.rsplit_once(':')?;
        Some(format!("tcp://{host}:{port}"))
    }

    /// Result of a replay: `messages` are (seq frame, payload) pairs as
    /// received (the end marker excluded); `Err` when the replay failed.
    pub fn finish_replay(
        &mut self,
        req: &ReplayRequest,
        messages: Result<Vec<(u64, Vec<u8>)>, String>,
        now_ms: u64,
    ) {
        let Some(&key) = self.by_address.get(&req.pod) else {
            return;
        };
        let pending = match self
            .pods
            .get_mut(&key)
            .and_then(|p| p.sources.get_mut(&req.rank))
        {
            Some(s) if s.replay.as_ref().map(|p| p.id) == Some(req.id) => s.replay.take(),
            _ => None,
        };
        let Some(pending) = pending else {
            return;
        };
        match messages {
            Ok(msgs) => {
                self.metrics.replay("ok");
                let mut next = pending.from;
                for (seq, payload) in msgs {
                    if seq < next {
                        continue;
                    }
                    if pending.buffered.first().is_some_and(|(s, _, _)| seq >= *s) {
                        break;
                    }
                    if let Some(b) = self.decode(&payload) {
                        self.apply_in_order(key, req.rank, seq, b, now_ms, now_ms);
                        self.metrics.replayed_messages.inc();
                        next = seq + 1;
                    }
                }
            }
            Err(_) => self.metrics.replay("failed"),
        }
        self.flush_after_replay(key, req.rank, pending, now_ms);
    }
}
