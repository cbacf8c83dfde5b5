//! Publication: what changed in the singleton's index since the last flush
//! written to shared data, where every worker VM reads it, and the index's
//! gauges.

use super::Singleton;
use crate::host;
use proxy_wasm::types::LogLevel;

/// Shared-data keys one flush writes at most (about 1.6 µs each for a 4 KiB
/// bucket: ≈ 13 ms of the main thread; a full 1,000-pod index is published
/// in 4 flushes); the rest waits for the next flush (`kvroute.index.deferred`).
const MAX_FLUSH_WRITES: usize = 8192;

/// Keys one batch of a flush encodes before writing them (≈ 1.2 MB of full
/// buckets at most).
const FLUSH_BATCH_WRITES: usize = 256;

impl Singleton {
    /// Publishes what changed in the index since the last flush (pod
    /// table, new sets, buckets, then the head with its heartbeat).
    /// Published in batches of [`FLUSH_BATCH_WRITES`] keys: the encoded
    /// buckets of a whole flush are never in memory at once.
    pub(super) fn flush(&mut self, now_ms: u64) {
        let started = host::now();
        let mut room = MAX_FLUSH_WRITES;
        let mut written = 0;
        let deferred = loop {
            let batch = room.min(FLUSH_BATCH_WRITES);
            let Some(publication) = self.cluster.publish(batch, self.writer, now_ms) else {
                return;
            };
            for (key, value) in &publication.writes {
                if host::shared_set(key, value, 0) {
                    written += 1;
                } else {
                    host::log(
                        LogLevel::Warn,
                        &format!("kvroute singleton: could not write shared data key {key}"),
                    );
                }
            }
            // Every answer ends with the head.
            let stored = publication.writes.len().saturating_sub(1);
            room = room.saturating_sub(stored);
            if publication.deferred == 0 || room == 0 || stored == 0 {
                break publication.deferred;
            }
        };
        let m = &self.index_metrics;
        m.flushed.add(written);
        m.flush_us.add(started.elapsed_us());
        m.deferred.record(deferred as u64);
        if let Some(index) = self.cluster.index() {
            let stats = index.stats();
            m.blocks.record(stats.blocks as u64);
            m.bytes.record(stats.bytes as u64);
            m.evicted.record(stats.evicted);
            m.dropped.record(stats.dropped);
            m.resident_buckets.record(stats.resident_buckets as u64);
            m.resident_bytes.record(stats.resident_bytes as u64);
            m.written_back_early.record(stats.written_back_early);
            m.read_back.record(stats.read_back);
            m.unloadable.record(stats.unloadable);
        }
        m.writer_memory_bytes.record(linear_memory_bytes());
    }
}

/// Bytes of this VM's linear memory: its heap's high-water mark (a wasm
/// memory grows and never shrinks).
fn linear_memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    let pages = core::arch::wasm32::memory_size::<0>() as u64;
    #[cfg(not(target_arch = "wasm32"))]
    let pages = 0;
    pages * 65_536
}
