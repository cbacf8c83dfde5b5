//! Per-request messages a worker VM owes its peers (a tenant's budget
//! charges), sent together.
//!
//! Every queue message wakes each peer's VM: sent one by one, each request
//! would cost W − 1 enqueues and wake-ups inside its own callbacks. The
//! outbox holds them for at most its delay and hands them out as one batch:
//! peers learn of them that much later, and a busy VM sends one message per
//! peer per delay instead of one per request. (The workers' load is shared
//! without messages: [`crate::peer_load`].)

use crate::wire::PeerMessage;

/// What [`Outbox::push`] asks of the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed {
    /// The outbox was empty: arrange to be called back ([`Outbox::due`])
    /// within the delay.
    Armed,
    /// Held with earlier messages; a call-back is already arranged.
    Held,
}

#[derive(Debug)]
pub struct Outbox {
    messages: Vec<PeerMessage>,
    /// When the oldest held message was pushed.
    oldest_ms: u64,
    delay_ms: u64,
}

impl Outbox {
    pub fn new(delay_ms: u64) -> Outbox {
        Outbox {
            messages: Vec::new(),
            oldest_ms: 0,
            delay_ms,
        }
    }

    pub fn delay_ms(&self) -> u64 {
        self.delay_ms
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    pub fn push(&mut self, message: PeerMessage, now_ms: u64) -> Pushed {
        let armed = self.messages.is_empty();
        if armed {
            self.oldest_ms = now_ms;
        }
        self.messages.push(message);
        if armed {
            Pushed::Armed
        } else {
            Pushed::Held
        }
    }

    /// The held messages, once the oldest has waited the delay (a timer may
    /// fire a little early); `None` before, or when nothing is held.
    pub fn due(&mut self, now_ms: u64) -> Option<Vec<PeerMessage>> {
        let waited = now_ms.saturating_sub(self.oldest_ms);
        if self.messages.is_empty() || waited + 1 < self.delay_ms {
            return None;
        }
        Some(std::mem::take(&mut self.messages))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::ClientKey;

    fn charged(pod: &str) -> PeerMessage {
        PeerMessage::Charged {
            pod: pod.into(),
            client: ClientKey::new(1),
            blocks: 3,
        }
    }

    #[test]
    fn the_first_message_arms_and_later_ones_join_it() {
        let mut outbox = Outbox::new(10);
        assert_eq!(outbox.push(charged("a"), 100), Pushed::Armed);
        assert_eq!(outbox.push(charged("b"), 104), Pushed::Held);
        assert!(!outbox.is_empty());
        assert_eq!(outbox.due(105), None, "the oldest waited 5 of 10 ms");
        assert_eq!(outbox.due(110), Some(vec![charged("a"), charged("b")]));
        assert!(outbox.is_empty());
        assert_eq!(outbox.due(200), None, "nothing held");
        assert_eq!(outbox.push(charged("c"), 200), Pushed::Armed);
    }

    #[test]
    fn the_delay_runs_from_the_oldest_message() {
        let mut outbox = Outbox::new(10);
        outbox.push(charged("a"), 100);
        outbox.push(charged("b"), 109);
        assert_eq!(outbox.due(109), Some(vec![charged("a"), charged("b")]));
    }

    #[test]
    fn no_delay_is_due_at_once() {
        let mut outbox = Outbox::new(0);
        outbox.push(charged("a"), 7);
        assert_eq!(outbox.due(7), Some(vec![charged("a")]));
        assert_eq!(outbox.due(100), None);
    }
}
