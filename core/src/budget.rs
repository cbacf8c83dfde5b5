//! How many blocks one client may teach a pod's table: a client that floods
//! a pod with huge prompts cannot flush what other clients taught it. Each
//! pod keeps a few clients' budgets, each for a window as long as a learned
//! entry lives; a window's budget is spent by the blocks the client taught.

use xxhash_rust::xxh3::xxh3_64;

/// The budget key of a client: a digest of its identity, never a block hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct ClientKey(u64);

impl ClientKey {
    /// The key a peer message carried.
    pub const fn new(key: u64) -> ClientKey {
        ClientKey(key)
    }

    /// The bare u64, for a peer message.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// The budget key of a client identity (e.g. its tenant's `cache_salt`).
pub fn client_key(identity: &str) -> ClientKey {
    ClientKey(xxh3_64(identity.as_bytes()))
}

/// Clients tracked per pod; beyond this the one whose window started
/// first is forgotten (it then starts a fresh window: a bound, not a ban).
const MAX_CLIENTS: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Budget {
    client: ClientKey,
    window_start_s: u32,
    taught: u64,
}

/// The budgets of the clients that recently taught one pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientBudgets {
    budgets: Vec<Budget>,
}

impl ClientBudgets {
    /// How many of `want` blocks `client` may teach now, at most `limit`
    /// per window of `window_s` seconds; what it may teach is charged.
    pub fn charge(
        &mut self,
        client: ClientKey,
        want: usize,
        limit: u64,
        now_s: u32,
        window_s: u32,
    ) -> usize {
        let i = match self.budgets.iter().position(|b| b.client == client) {
            Some(i) => i,
            None => {
                if self.budgets.len() == MAX_CLIENTS {
                    if let Some(oldest) =
                        (0..self.budgets.len()).min_by_key(|&i| self.budgets[i].window_start_s)
                    {
                        self.budgets.swap_remove(oldest);
                    }
                }
                self.budgets.push(Budget {
                    client,
                    window_start_s: now_s,
                    taught: 0,
                });
                self.budgets.len() - 1
            }
        };
        let budget = &mut self.budgets[i];
        if now_s.saturating_sub(budget.window_start_s) >= window_s {
            budget.window_start_s = now_s;
            budget.taught = 0;
        }
        let allowed = limit.saturating_sub(budget.taught).min(want as u64);
        budget.taught += allowed;
        allowed as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_teaches_at_most_its_limit_per_window() {
        let mut b = ClientBudgets::default();
        let (one, two) = (client_key("one"), client_key("two"));
        assert_eq!(b.charge(one, 600, 1000, 0, 600), 600);
        assert_eq!(b.charge(one, 600, 1000, 10, 600), 400);
        assert_eq!(b.charge(one, 600, 1000, 20, 600), 0);
        // Other clients have budgets of their own.
        assert_eq!(b.charge(two, 600, 1000, 20, 600), 600);
        // A new window, a new budget.
        assert_eq!(b.charge(one, 600, 1000, 600, 600), 600);
    }

    #[test]
    fn the_number_of_clients_tracked_is_bounded() {
        let mut b = ClientBudgets::default();
        for client in 0..1000u64 {
            assert_eq!(
                b.charge(ClientKey(client), 10, 10, client as u32, 10_000),
                10
            );
        }
        assert_eq!(b.budgets.len(), MAX_CLIENTS);
        // The most recent clients are still charged.
        assert_eq!(b.charge(ClientKey(999), 10, 10, 1000, 10_000), 0);
    }
}
