//! The singleton's half of the workers' load sharing: every
//! [`LOAD_SHARE_MS`] while enough workers serve (`peer_load::is_summed`), it reads their load
//! keys and writes their sum to one key, so that each deciding worker reads
//! one key instead of one per peer (see `kvroute_core::peer_load`).

use crate::host;
use kvroute_core::peer_load::{
    self, LoadSnapshot, LoadSum, LOAD_SHARE_MS, SUM_KEY, SUM_REWRITE_MS,
};
use proxy_wasm::types::LogLevel;

#[derive(Debug, Default)]
pub struct LoadSummer {
    /// The sum last written, and when.
    last: Option<LoadSum>,
    written_ms: u64,
}

impl LoadSummer {
    /// How often the singleton must tick for the sum: every share period
    /// while enough workers serve (`serving` of them), else never.
    pub fn period_ms(serving: usize) -> Option<u64> {
        peer_load::is_summed(serving).then_some(LOAD_SHARE_MS)
    }

    /// Sums the load of the workers whose keys are `keys`, when there are
    /// enough; writes the sum when it changed, or to keep it fresh.
    pub fn tick(&mut self, keys: &[String], now_ms: u64) {
        if LoadSummer::period_ms(keys.len()).is_none() {
            return;
        }
        let snapshots: Vec<(&str, LoadSnapshot)> = keys
            .iter()
            .filter_map(|key| {
                let (bytes, _) = host::shared_get(key)?;
                LoadSnapshot::decode(&bytes).ok().map(|s| (key.as_str(), s))
            })
            .collect();
        let sum = LoadSum::of(snapshots.iter().map(|(key, s)| (*key, s)), now_ms);
        let unchanged = self
            .last
            .as_ref()
            .is_some_and(|last| last.counted == sum.counted && last.pods == sum.pods);
        if unchanged && now_ms.saturating_sub(self.written_ms) < SUM_REWRITE_MS {
            return;
        }
        match sum.encode() {
            Ok(bytes) if host::shared_set(SUM_KEY, &bytes, 0) => {
                self.written_ms = now_ms;
                self.last = Some(sum);
            }
            Ok(_) => host::log(
                LogLevel::Warn,
                "kvroute singleton: could not write the workers' load sum",
            ),
            Err(e) => host::log(
                LogLevel::Warn,
                &format!("kvroute singleton: load sum not written: {e}"),
            ),
        }
    }
}
