//! A root context's tick: the period set with the host (changed only when
//! it differs: each change is a host call) and when its periodic duties
//! last ran. Shared by the worker VMs and the singleton.

use crate::host;

#[derive(Debug)]
pub struct Ticker {
    period_ms: u64,
    duties_ms: u64,
}

impl Ticker {
    /// The tick as the root context set it at configure time.
    pub fn new(period_ms: u64) -> Ticker {
        Ticker {
            period_ms,
            duties_ms: 0,
        }
    }

    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }

    pub fn set_period(&mut self, period_ms: u64) {
        if self.period_ms != period_ms {
            self.period_ms = period_ms;
            host::set_tick_period(period_ms);
        }
    }

    /// Whether the duties of period `duty_ms` are due at `now_ms` (a tick
    /// may fire a millisecond early); when they are, they count as run.
    pub fn duties_due(&mut self, now_ms: u64, duty_ms: u64) -> bool {
        let due = now_ms.saturating_sub(self.duties_ms) + 1 >= duty_ms;
        if due {
            self.duties_ms = now_ms;
        }
        due
    }
}
