//! When the singleton forwards the pod list to the worker VMs after a feed
//! answer. Workers need the list with its load, and word that the feed is
//! alive (their trust in precise entries lapses without it, after at least
//! 5 s); the block operations only the singleton applies (it writes the
//! index). The whole list at every poll cost each worker O(pods) work ten
//! times a second, idle or not (docs/results/2026-12-04-feed-forward), and
//! word at every poll woke every worker ten times a second
//! (docs/results/2026-12-04-idle-feed). So the list goes when a worker may
//! lack it, and at least once a second as that word; nothing in between.

/// The list goes at least this often: it renews the workers' trust, and
/// reaches a worker that did not take the last one (its enqueue failed, or
/// it could not decode it).
pub const FULL_LIST_EVERY_MS: u64 = 1_000;

/// When the last list went, and to which queues.
#[derive(Debug, Default)]
pub struct ListForwarding {
    sent_to: Vec<u32>,
    sent_ms: Option<u64>,
}

impl ListForwarding {
    /// Whether the pod list goes to `recipients` after this feed answer: it
    /// or its load changed, a recipient was not sent the last one, or that
    /// one is [`FULL_LIST_EVERY_MS`] old.
    pub fn list_due(&mut self, changed: bool, recipients: &[u32], now_ms: u64) -> bool {
        let newcomer = recipients.iter().any(|q| !self.sent_to.contains(q));
        let due = self
            .sent_ms
            .is_none_or(|at| now_ms.saturating_sub(at) >= FULL_LIST_EVERY_MS);
        let full = changed || newcomer || due;
        if full {
            self.sent_to = recipients.to_vec();
            self.sent_ms = Some(now_ms);
        }
        full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_list_goes_when_it_changed_to_a_newcomer_or_once_a_second() {
        // (list changed, recipients, now ms, whole list expected, why)
        let steps: [(bool, &[u32], u64, bool, &str); 9] = [
            (false, &[1, 2], 0, true, "the first forward"),
            (false, &[1, 2], 100, false, "nothing new"),
            (true, &[1, 2], 200, true, "the list changed"),
            (false, &[2, 1], 300, false, "the same workers"),
            (false, &[2], 400, false, "a worker left"),
            (false, &[2, 3], 500, true, "a worker joined"),
            (false, &[2, 3], 1_499, false, "under a second since"),
            (false, &[2, 3], 1_500, true, "a second passed"),
            (false, &[], 1_600, false, "no worker"),
        ];
        let mut forwarding = ListForwarding::default();
        for (changed, recipients, now_ms, full, why) in steps {
            assert_eq!(
                forwarding.list_due(changed, recipients, now_ms),
                full,
                "{why}"
            );
        }
    }
}
