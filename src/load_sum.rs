//! The singleton's half of the workers' load sharing: while enough workers
//! serve (`peer_load::is_summed`), it reads their load keys and writes their
//! sum to one key, so that each deciding worker reads one key instead of one
//! per peer (see `kvroute_core::peer_load`). When and how often:
//! [`SumSchedule`].

use crate::host::{self, Metric};
use kvroute_core::peer_load::{self, LoadSnapshot, LoadSum, SumSchedule, SUM_KEY};
use proxy_wasm::types::LogLevel;

#[derive(Debug)]
pub struct LoadSummer {
    schedule: SumSchedule,
    /// Counter `kvroute.peer.sums_written`.
    written: Metric,
}

impl LoadSummer {
    pub fn define() -> LoadSummer {
        LoadSummer {
            schedule: SumSchedule::default(),
            written: Metric::counter("kvroute.peer.sums_written"),
        }
    }

    /// How often the singleton must tick for the sum: every share period
    /// while enough workers serve (`serving` of them) and there is load to
    /// sum, else `None` (its duty ticks suffice).
    pub fn period_ms(&self, serving: usize) -> Option<u64> {
        self.schedule.period_ms(serving)
    }

    /// Sums the load of the workers whose keys are `keys`, when there are
    /// enough; writes the sum when the schedule says so.
    pub fn tick(&mut self, keys: &[String], now_ms: u64) {
        if !peer_load::is_summed(keys.len()) {
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
        if !self.schedule.due(&sum, now_ms) {
            return;
        }
        match sum.encode() {
            Ok(bytes) if host::shared_set(SUM_KEY, &bytes, 0) => {
                self.schedule.written(sum, now_ms);
                self.written.inc();
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
