//! What the singleton forwards to the worker VMs after a feed answer. Workers
//! need the pod list with its load, and word that the feed is alive (their
//! trust in precise entries lapses without it, after at least 5 s); the
//! block operations only the singleton applies (it writes the index). The
//! whole list at every poll cost each worker O(pods) work ten times a second,
//! idle or not (docs/results/2026-12-04-feed-forward), and word at every poll
//! woke every worker ten times a second (docs/results/2026-12-04-idle-feed).
//! The list once a second still cost each worker 0.5–0.9 ms at 1,000 pods
//! (decoding and comparing it natively), so the list goes when it changed or
//! a worker may lack it, the load alone when only that changed (the indexer
//! scrapes the pods once a second), the word alone once a second, nothing in
//! between.

/// The word that the feed is alive goes at least this often.
pub const WORD_EVERY_MS: u64 = 1_000;

/// An unchanged list goes again this often: it reaches a worker that did not
/// take the last one (its enqueue failed, or it could not decode it). Such a
/// worker also skips the load-only updates meanwhile, which name the list's
/// pods by their place.
pub const FULL_LIST_EVERY_MS: u64 = 10_000;

/// What a feed answer changed of the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodsChanged {
    /// A new list (with its load).
    List,
    /// Only their load.
    Load,
    Nothing,
}

/// What goes to the workers after a feed answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    /// The pod list with its load (which also says the feed is alive).
    List,
    /// The pods' load alone, in list order (which also says the feed is alive).
    Load,
    /// Word that the feed is alive, without the list.
    Alive,
    Nothing,
}

/// When the last list and the last word went, and to which queues.
#[derive(Debug, Default)]
pub struct ListForwarding {
    sent_to: Vec<u32>,
    list_ms: Option<u64>,
    word_ms: Option<u64>,
}

impl ListForwarding {
    /// What goes to `recipients` after a feed answer that `changed` this:
    /// the list when it changed, a recipient was not sent the last one, or
    /// that one is [`FULL_LIST_EVERY_MS`] old; else the load when only that
    /// changed; else the word when the last word (or load) is
    /// [`WORD_EVERY_MS`] old.
    pub fn due(&mut self, changed: PodsChanged, recipients: &[u32], now_ms: u64) -> Forward {
        let newcomer = recipients.iter().any(|q| !self.sent_to.contains(q));
        let older_than =
            |at: Option<u64>, ms: u64| at.is_none_or(|at| now_ms.saturating_sub(at) >= ms);
        if changed == PodsChanged::List || newcomer || older_than(self.list_ms, FULL_LIST_EVERY_MS)
        {
            self.sent_to = recipients.to_vec();
            self.list_ms = Some(now_ms);
            self.word_ms = Some(now_ms);
            Forward::List
        } else if changed == PodsChanged::Load {
            self.word_ms = Some(now_ms);
            Forward::Load
        } else if older_than(self.word_ms, WORD_EVERY_MS) {
            self.word_ms = Some(now_ms);
            Forward::Alive
        } else {
            Forward::Nothing
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_goes_when_it_changed_to_a_newcomer_or_every_ten_seconds_the_load_when_it_changed_the_word_once_a_second(
    ) {
        use Forward::*;
        use PodsChanged as Changed;
        // (what changed, recipients, now ms, what goes, why)
        let steps: [(Changed, &[u32], u64, Forward, &str); 16] = [
            (Changed::Nothing, &[1, 2], 0, List, "the first forward"),
            (Changed::Nothing, &[1, 2], 100, Nothing, "nothing new"),
            (Changed::List, &[1, 2], 200, List, "the list changed"),
            (Changed::Nothing, &[2, 1], 300, Nothing, "the same workers"),
            (Changed::Nothing, &[2], 400, Nothing, "a worker left"),
            (Changed::Nothing, &[2, 3], 500, List, "a worker joined"),
            (Changed::Load, &[2, 3], 600, Load, "only the load changed"),
            (
                Changed::Load,
                &[2, 3, 4],
                700,
                List,
                "a load change with a newcomer",
            ),
            (
                Changed::Nothing,
                &[2, 3, 4],
                1_699,
                Nothing,
                "under a second since",
            ),
            (
                Changed::Nothing,
                &[2, 3, 4],
                1_700,
                Alive,
                "a second passed",
            ),
            (Changed::Load, &[2, 3, 4], 2_000, Load, "the load again"),
            (
                Changed::Nothing,
                &[2, 3, 4],
                2_999,
                Nothing,
                "under a second since the load",
            ),
            (
                Changed::Nothing,
                &[],
                3_000,
                Alive,
                "no worker: the word costs nothing",
            ),
            (
                Changed::Nothing,
                &[2, 3, 4],
                10_699,
                Alive,
                "the word, under ten seconds since the list",
            ),
            (
                Changed::Load,
                &[2, 3, 4],
                10_700,
                List,
                "ten seconds since the list",
            ),
            (
                Changed::Nothing,
                &[2, 3, 4],
                11_000,
                Nothing,
                "the list was the word",
            ),
        ];
        let mut forwarding = ListForwarding::default();
        for (changed, recipients, now_ms, what, why) in steps {
            assert_eq!(forwarding.due(changed, recipients, now_ms), what, "{why}");
        }
    }
}
